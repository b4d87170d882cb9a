"""Triton kernel for `kernels.bitmask` (same signatures as `bitmask_reference`).

One program covers BLOCK_WORDS mask words (32*BLOCK_WORDS columns) of one row,
laid out as a [BLOCK_WORDS, 32] tile so each word is loaded once and its 32
bits are broadcast. Logits are never read: the kernel only *stores* -inf where
a bit is 0, so the bytes moved are the mask plus the disallowed logits.
Imported lazily (see kernels.backend).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 64 words = 2048 columns per program: enough work to hide the mask load on a
# GPU, and few enough programs that the CPU interpreter stays quick on 152k vocabs.
BLOCK_WORDS = 64


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,  # [num_rows, V] float, strides (stride_lr, stride_lc)
    mask_ptr,  # [num_mask_rows, W] int32, strides (stride_mr, 1)
    row_ids_ptr,  # [num_rows] int32/int64; only read when INDIRECT
    V,
    W,
    stride_lr,
    stride_lc,
    stride_mr,
    INDIRECT: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
):
    row = tl.program_id(0)
    word_block = tl.program_id(1)
    if INDIRECT:
        mask_row = tl.load(row_ids_ptr + row).to(tl.int64)
    else:
        mask_row = row.to(tl.int64)
    words = word_block * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)  # [BLOCK_WORDS]
    # Words past W read as 0: columns beyond the mask (padded model vocab) are disallowed.
    packed = tl.load(mask_ptr + mask_row * stride_mr + words, mask=words < W, other=0)  # [BLOCK_WORDS]
    bit = tl.arange(0, 32)  # [32]
    allowed = ((packed[:, None] >> bit[None, :]) & 1) != 0  # [BLOCK_WORDS, 32]
    cols = words[:, None] * 32 + bit[None, :]  # [BLOCK_WORDS, 32]
    neg_inf = tl.full([BLOCK_WORDS, 32], float("-inf"), logits_ptr.dtype.element_ty)
    ptrs = logits_ptr + row.to(tl.int64) * stride_lr + cols.to(tl.int64) * stride_lc
    tl.store(ptrs, neg_inf, mask=(cols < V) & ~allowed)


def _launch(
    logits: torch.Tensor,  # [num_rows, V] float
    mask: torch.Tensor,  # [num_mask_rows, W] int32
    row_ids: torch.Tensor | None,  # [num_rows] int
) -> None:
    num_rows, vocab = logits.shape
    if num_rows == 0 or vocab == 0:
        return
    mask = mask.contiguous()
    num_words = mask.shape[1]
    # The grid spans the *logits* width in words, so columns past the mask are reached.
    grid = (num_rows, triton.cdiv(triton.cdiv(vocab, 32), BLOCK_WORDS))
    _apply_bitmask_kernel[grid](
        logits,
        mask,
        row_ids if row_ids is not None else mask,
        vocab,
        num_words,
        logits.stride(0),
        logits.stride(1),
        mask.stride(0),
        INDIRECT=row_ids is not None,
        BLOCK_WORDS=BLOCK_WORDS,
    )


def apply_token_bitmask_inplace(
    logits: torch.Tensor,  # [num_rows, V] float, modified in place
    bitmask: torch.Tensor,  # [num_rows, W] int32
) -> None:
    _launch(logits, bitmask, None)


def apply_token_bitmask_indirect_inplace(
    logits: torch.Tensor,  # [num_rows, V] float, modified in place
    mask_table: torch.Tensor,  # [num_table_rows, W] int32
    row_ids: torch.Tensor,  # [num_rows] int32
) -> None:
    _launch(logits, mask_table, row_ids.contiguous())
