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


def _popcounts(valid_rows: torch.Tensor) -> torch.Tensor:  # [n, W] int32 (tail cleared) -> [n] int32
    as_bytes = valid_rows.contiguous().view(torch.uint8).long()  # [n, 4W]
    return _BYTE_POPCOUNT[as_bytes].sum(dim=-1, dtype=torch.int32)


def allowed_counts(rows: torch.Tensor, vocab_size: int) -> torch.Tensor:  # -> [n] int32
    """Number of allowed tokens < vocab_size in each row of ``rows`` [n, W] int32."""
    return _popcounts(_valid_bits(rows.cpu(), vocab_size))


def single_allowed_tokens(rows: torch.Tensor, vocab_size: int) -> list[int | None]:
    """Per row of ``rows`` [n, W] int32: the token id if the row allows exactly one
    token < vocab_size, else None. One popcount over all rows: forced detection runs
    for the whole batch at every draft position."""
    valid = _valid_bits(rows.cpu(), vocab_size)  # [n, W]
    out: list[int | None] = [None] * valid.shape[0]
    for r in torch.nonzero(_popcounts(valid) == 1).flatten().tolist():
        word = int(torch.nonzero(valid[r]).flatten()[0])
        bits = int(valid[r, word]) & 0xFFFFFFFF  # int32 -> its unsigned bit pattern
        out[r] = 32 * word + bits.bit_length() - 1
    return out


def single_allowed_token(row: torch.Tensor, vocab_size: int) -> int | None:
    """The token id if ``row`` [W] allows exactly one token < vocab_size, else None."""
    return single_allowed_tokens(row.unsqueeze(0), vocab_size)[0]


def is_allowed(row: torch.Tensor, token_id: int) -> bool:
    """Whether bit ``token_id`` of ``row`` [W] int32 is set."""
    word = token_id >> 5
    if not 0 <= word < row.shape[-1]:
        return False
    return bool((int(row[word]) >> (token_id & 31)) & 1)


def all_ones_row(num_mask_words: int, device: torch.device | str = "cpu") -> torch.Tensor:  # -> [W] int32
    """A row that allows everything: the mask of a sequence without a grammar."""
    return torch.full((num_mask_words,), -1, dtype=torch.int32, device=device)
