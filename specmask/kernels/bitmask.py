"""Apply a packed grammar bitmask to logits in place (docs/design.md step 3).

Bitmask wire format (docs/design.md): row-major int32, `num_mask_words = W =
ceil(V_mask / 32)` words per row, bit j of word w stands for token 32*w + j,
1 = allowed. This is xgrammar's and llguidance's layout, so masks from the mask
service are used as they arrive.

Semantics, identical in both backends:
* column c < min(V, 32*W): set to -inf where bit c is 0;
* column c >= 32*W (the model's padded vocab beyond the tokenizer's): -inf,
  because no grammar can ever allow a token the tokenizer does not have;
* logits may be non-contiguous (any strides); they are modified in place.

Two entry points share one kernel: the direct form (row i of logits uses row i
of the bitmask) and the indirect form, where each logits row names a row of a
table of interned mask rows, so a row repeated across positions or requests is
uploaded to the device once.
"""

from __future__ import annotations

import torch

from specmask.kernels.backend import Backend, resolve_backend

__all__ = ["apply_token_bitmask_indirect_inplace", "apply_token_bitmask_inplace"]


def _check(logits: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if mask.dim() != 2 or mask.dtype != torch.int32:
        raise ValueError(f"{name} must be a 2-D int32 tensor, got {mask.dtype} {tuple(mask.shape)}")
    if mask.device != logits.device:
        raise ValueError(f"{name} is on {mask.device}, logits on {logits.device}")


def apply_token_bitmask_inplace(
    logits: torch.Tensor,  # [num_rows, V] float, modified in place
    bitmask: torch.Tensor,  # [num_rows, W] int32
    *,
    backend: Backend | None = None,
) -> Backend:
    """Set disallowed logits to -inf; returns the backend that ran."""
    _check(logits, bitmask, "bitmask")
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits {logits.shape[0]}")
    ran = resolve_backend(backend, logits.device)
    if ran is Backend.TRITON:
        from specmask.kernels import bitmask_triton

        bitmask_triton.apply_token_bitmask_inplace(logits, bitmask)
    else:
        from specmask.kernels import bitmask_reference

        bitmask_reference.apply_token_bitmask_inplace(logits, bitmask)
    return ran


def apply_token_bitmask_indirect_inplace(
    logits: torch.Tensor,  # [num_rows, V] float, modified in place
    mask_table: torch.Tensor,  # [num_table_rows, W] int32, interned mask rows
    row_ids: torch.Tensor,  # [num_rows] int32, row of mask_table for each logits row
    *,
    backend: Backend | None = None,
) -> Backend:
    """Like `apply_token_bitmask_inplace`, with logits row i masked by mask_table[row_ids[i]]."""
    _check(logits, mask_table, "mask_table")
    if row_ids.dim() != 1 or row_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"row_ids must be [{logits.shape[0]}], got {tuple(row_ids.shape)}")
    if row_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"row_ids must be int32 or int64, got {row_ids.dtype}")
    ran = resolve_backend(backend, logits.device)
    if ran is Backend.TRITON:
        from specmask.kernels import bitmask_triton

        bitmask_triton.apply_token_bitmask_indirect_inplace(logits, mask_table, row_ids)
    else:
        from specmask.kernels import bitmask_reference

        bitmask_reference.apply_token_bitmask_indirect_inplace(logits, mask_table, row_ids)
    return ran
