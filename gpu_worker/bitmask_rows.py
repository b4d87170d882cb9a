"""Host-side questions about packed grammar mask rows (DESIGN.md wire format).

A row is ``W = ceil(V / 32)`` int32 words; bit j of word w is token 32*w + j.
Bits at or past the logits width V stand for no token and are ignored (rows
"past the stop" arrive all-ones, tail bits included).
"""

from __future__ import annotations

import torch

# popcount of every byte value, for counting allowed tokens without a Python loop.
_BYTE_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int32)


def _valid_bits(rows: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [n, W] int32
    """Clear tail bits >= vocab_size (a copy)."""
    rows = rows.clone()
    tail = vocab_size % 32
    if tail and rows.shape[-1] == (vocab_size + 31) // 32:
        rows[..., -1] &= (1 << tail) - 1
    return rows


def allowed_counts(rows: torch.Tensor, vocab_size: int) -> torch.Tensor:  # -> [n] int32
    """Number of allowed tokens < vocab_size in each row of ``rows`` [n, W] int32."""
    as_bytes = _valid_bits(rows.cpu(), vocab_size).contiguous().view(torch.uint8).long()  # [n, 4W]
    return _BYTE_POPCOUNT[as_bytes].sum(dim=-1, dtype=torch.int32)


def single_allowed_token(row: torch.Tensor, vocab_size: int) -> int | None:
    """The token id if ``row`` [W] allows exactly one token < vocab_size, else None."""
    row = row.cpu()
    if int(allowed_counts(row.unsqueeze(0), vocab_size)[0]) != 1:
        return None
    words = _valid_bits(row.unsqueeze(0), vocab_size)[0]
    word = int(torch.nonzero(words).flatten()[0])
    bits = int(words[word]) & 0xFFFFFFFF  # int32 -> its unsigned bit pattern
    return 32 * word + bits.bit_length() - 1


def is_allowed(row: torch.Tensor, token_id: int) -> bool:
    """Whether bit ``token_id`` of ``row`` [W] int32 is set."""
    word = token_id >> 5
    if not 0 <= word < row.shape[-1]:
        return False
    return bool((int(row[word]) >> (token_id & 31)) & 1)


def all_ones_row(num_mask_words: int, device: torch.device | str = "cpu") -> torch.Tensor:  # -> [W] int32
    """A row that allows everything: the mask of a sequence without a grammar."""
    return torch.full((num_mask_words,), -1, dtype=torch.int32, device=device)
