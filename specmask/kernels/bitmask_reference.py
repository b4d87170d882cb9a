"""Plain PyTorch reference for `kernels.bitmask` (same signatures, same results)."""

from __future__ import annotations

import torch

BITS_PER_WORD = 32


def unpack_bitmask(
    bitmask: torch.Tensor,  # [num_rows, W] int32
    num_cols: int,
) -> torch.Tensor:  # [num_rows, num_cols] bool, True = allowed
    """Expand packed words to one bool per token; columns >= 32*W are False."""
    num_rows, num_words = bitmask.shape
    shifts = torch.arange(BITS_PER_WORD, device=bitmask.device, dtype=torch.int32)  # [32]
    # Arithmetic shift of a signed word then `& 1` reads bit 31 correctly too.
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [num_rows, W, 32]
    allowed = bits.reshape(num_rows, num_words * BITS_PER_WORD).bool()  # [num_rows, 32*W]
    if num_cols <= allowed.shape[1]:
        return allowed[:, :num_cols]
    pad = torch.zeros(num_rows, num_cols - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask_inplace(
    logits: torch.Tensor,  # [num_rows, V] float, modified in place
    bitmask: torch.Tensor,  # [num_rows, W] int32
) -> None:
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [num_rows, V]
    logits.masked_fill_(~allowed, float("-inf"))


def apply_token_bitmask_indirect_inplace(
    logits: torch.Tensor,  # [num_rows, V] float, modified in place
    mask_table: torch.Tensor,  # [num_table_rows, W] int32
    row_ids: torch.Tensor,  # [num_rows] int32
) -> None:
    apply_token_bitmask_inplace(logits, mask_table.index_select(0, row_ids.long()))
