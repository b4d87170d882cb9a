"""Triton kernel for `kernels.recovered.sample_recovered_tokens` (same signature
as `recovered_reference`). One program per target row, a loop over the vocab in
BLOCK_V chunks carrying a running (max, first index): the result equals
torch.argmax (first maximum) because a later chunk replaces the running best
only when strictly larger.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 4096 fp32 = 16 KiB per operand per iteration: long enough loads for bandwidth
# on a GPU, few enough iterations for the CPU interpreter.
BLOCK_V = 4096


@triton.jit
def _recovered_kernel(
    logits_ptr,  # [num_tokens, V] float, strides (stride_lr, stride_lc)
    probs_ptr,  # [num_tokens, V] float32 contiguous; unused when all greedy
    draft_ids_ptr,  # [num_draft_tokens] int64
    draft_probs_ptr,  # [num_draft_tokens, V] float32 contiguous; read when HAS_Q
    cu_ptr,  # [B] int32, cumulative k_r
    request_ptr,  # [num_tokens] int32
    temperature_ptr,  # [B] float32
    inv_noise_ptr,  # [B, V] float32 contiguous, 1/E
    out_ptr,  # [num_tokens] int64
    V,
    stride_lr,
    stride_lc,
    HAS_PROBS: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    req = tl.load(request_ptr + row)
    if req == 0:
        start = 0
    else:
        start = tl.load(cu_ptr + req - 1)
    num_drafts = tl.load(cu_ptr + req) - start
    pos = row - start - req  # position within the request; == num_drafts on the bonus row
    is_draft_row = pos < num_drafts
    # Without probabilities every request is greedy (the caller checked).
    greedy = (tl.load(temperature_ptr + req) == 0.0) | (not HAS_PROBS)
    row64 = row.to(tl.int64)

    if greedy:
        best = float("-inf")
        best_idx = 0
        for off in range(0, V, BLOCK_V):
            cols = off + tl.arange(0, BLOCK_V)  # [BLOCK_V]
            x = tl.load(
                logits_ptr + row64 * stride_lr + cols.to(tl.int64) * stride_lc,
                mask=cols < V,
                other=float("-inf"),
            ).to(tl.float32)
            block_max = tl.max(x, 0)
            block_idx = tl.argmax(x, 0, tie_break_left=True)
            if block_max > best:  # strict: earlier chunk wins ties, like torch.argmax
                best = block_max
                best_idx = off + block_idx
        tl.store(out_ptr + row, best_idx.to(tl.int64))  # type: ignore[attr-defined]  # a Triton scalar in the kernel
    else:
        draft_idx = (start + pos).to(tl.int64)
        # The bonus row has no draft: -1 matches no column, and q is not loaded.
        draft_token = tl.load(draft_ids_ptr + draft_idx, mask=is_draft_row, other=-1)
        q_cols = tl.where(is_draft_row, V, 0)  # bonus row: q = 0, nothing loaded
        best_w = -2.0
        best_w_idx = 0
        best_p = -2.0
        best_p_idx = 0
        for off in range(0, V, BLOCK_V):
            cols = off + tl.arange(0, BLOCK_V)  # [BLOCK_V]
            live = cols < V
            p = tl.load(probs_ptr + row64 * V + cols, mask=live, other=0.0)  # [BLOCK_V]
            inv = tl.load(inv_noise_ptr + req.to(tl.int64) * V + cols, mask=live, other=0.0)
            if HAS_Q:
                q = tl.load(draft_probs_ptr + draft_idx * V + cols, mask=cols < q_cols, other=0.0)
            else:
                # No draft distribution: q = 1 at d, so the residual is p with d removed.
                q = tl.where(cols == draft_token, 1.0, 0.0)
            w = tl.maximum(p - q, 0.0)
            # -1 where w = 0 (never beats a real score), -3 past V (never beats anything).
            w_score = tl.where(live, tl.where(w > 0.0, w * inv, -1.0), -3.0)
            p_score = tl.where(live, tl.where(p > 0.0, p * inv, -1.0), -3.0)
            w_max = tl.max(w_score, 0)
            w_arg = tl.argmax(w_score, 0, tie_break_left=True)
            p_max = tl.max(p_score, 0)
            p_arg = tl.argmax(p_score, 0, tie_break_left=True)
            if w_max > best_w:
                best_w = w_max
                best_w_idx = off + w_arg
            if p_max > best_p:
                best_p = p_max
                best_p_idx = off + p_arg
        # max(0, p - q) all zero (p == q): fall back to sampling p.
        token = tl.where(best_w >= 0.0, best_w_idx, best_p_idx)
        tl.store(out_ptr + row, token.to(tl.int64))


def sample_recovered_tokens(
    target_logits: torch.Tensor,  # [num_tokens, V] float
    target_probs: torch.Tensor | None,  # [num_tokens, V] float32
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64
    draft_probs: torch.Tensor | None,  # [num_draft_tokens, V] float32
    cu_num_draft_tokens: torch.Tensor,  # [B] int32
    request_index: torch.Tensor,  # [num_tokens] int32
    temperature: torch.Tensor,  # [B] float32
    inv_exp_noise: torch.Tensor,  # [B, V] float32
) -> torch.Tensor:  # [num_tokens] int64
    num_tokens, vocab = target_logits.shape
    out = torch.empty(num_tokens, dtype=torch.int64, device=target_logits.device)
    if num_tokens == 0:
        return out
    probs = target_probs.contiguous().float() if target_probs is not None else None
    q = draft_probs.contiguous().float() if draft_probs is not None else None
    _recovered_kernel[(num_tokens,)](
        target_logits,
        probs if probs is not None else target_logits,
        draft_token_ids.contiguous().long(),
        q if q is not None else target_logits,
        cu_num_draft_tokens.contiguous().to(torch.int32),
        request_index.contiguous().to(torch.int32),
        temperature.contiguous().float(),
        inv_exp_noise.contiguous().float(),
        out,
        vocab,
        target_logits.stride(0),
        target_logits.stride(1),
        HAS_PROBS=probs is not None,
        HAS_Q=q is not None,
        BLOCK_V=BLOCK_V,
    )
    return out
