"""Triton kernel for the accept loop of `kernels.rejection` (same signature as
`rejection_reference.rejection_accept`). One program per request walks its
drafts in order and stops at the first rejection (vLLM's
`rejection_random_sample_kernel`, greedy and random in one kernel). All vocab-
wide work happened in `kernels.recovered`; this kernel only reads k_r + 1
scalars per request, plus, with a mask table, one mask word per emitted token
(the structural never-lie guarantee: an emitted token its mask row forbids
turns the request's output into placeholders and sets its violation flag).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmask.kernels.rejection_reference import PLACEHOLDER_TOKEN_ID


@triton.jit
def _allowed(table_ptr, row_ids_ptr, row, token, W):
    """1 if mask row ``row_ids[row]`` allows ``token`` (one int32 word read), else 0."""
    word_idx = token >> 5
    in_range = (token >= 0) & (word_idx < W)
    table_row = tl.load(row_ids_ptr + row).to(tl.int64)
    word = tl.load(table_ptr + table_row * W + word_idx, mask=in_range, other=0)
    return tl.where(in_range, (word >> (token & 31).to(tl.int32)) & 1, 0)


@triton.jit
def _rejection_kernel(
    out_ptr,  # [B, K+1] int64, pre-filled with the placeholder
    num_accepted_ptr,  # [B] int32
    violation_ptr,  # [B] int32, 1 = an emitted token is outside its mask row
    table_ptr,  # [num_table_rows, W] int32 contiguous; read when HAS_MASK
    row_ids_ptr,  # [num_tokens] int64, mask_table row of each target row; read when HAS_MASK
    draft_ids_ptr,  # [num_draft_tokens] int64
    cu_ptr,  # [B] int32, cumulative k_r
    draft_probs_ptr,  # [num_draft_tokens, V] float32 contiguous; read when HAS_Q
    target_probs_ptr,  # [num_tokens, V] float32 contiguous; read when HAS_PROBS
    temperature_ptr,  # [B] float32
    uniforms_ptr,  # [num_draft_tokens] float32
    recovered_ptr,  # [num_tokens] int64
    V,
    W,
    out_stride,
    HAS_Q: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PLACEHOLDER: tl.constexpr,
):
    req = tl.program_id(0)
    if req == 0:
        start = 0
    else:
        start = tl.load(cu_ptr + req - 1)
    num_drafts = tl.load(cu_ptr + req) - start
    greedy = (tl.load(temperature_ptr + req) == 0.0) | (not HAS_PROBS)
    first_row = start + req  # target rows of request r start at cu[r-1] + r
    out_row = out_ptr + req.to(tl.int64) * out_stride

    num_acc = 0
    rejected = 0  # int, not bool: a loop-carried flag Triton lowers without surprises
    bad = 0  # 1 once an emitted token is outside its mask row
    for i in range(0, num_drafts):
        if rejected == 0:
            draft_idx = (start + i).to(tl.int64)  # type: ignore[attr-defined]  # a Triton scalar in the kernel
            row = (first_row + i).to(tl.int64)
            token = tl.load(draft_ids_ptr + draft_idx)
            recovered = tl.load(recovered_ptr + row)
            if greedy:
                accept = token == recovered
            else:
                # min(1, p/q) as u*q < p (Leviathan et al. 2023); p = 0 is never accepted.
                p_d = tl.load(target_probs_ptr + row * V + token)
                if HAS_Q:
                    q_d = tl.load(draft_probs_ptr + draft_idx * V + token)
                else:
                    q_d = 1.0
                accept = tl.load(uniforms_ptr + draft_idx) * q_d < p_d
            emitted = tl.where(accept, token, recovered)
            tl.store(out_row + i, emitted)
            if HAS_MASK:
                bad = bad | (1 - _allowed(table_ptr, row_ids_ptr, row, emitted, W))
            if accept:
                num_acc += 1
            else:
                rejected = 1
    if rejected == 0:
        # Every draft accepted: the bonus token from row k_r.
        bonus_row = (first_row + num_drafts).to(tl.int64)
        bonus = tl.load(recovered_ptr + bonus_row)
        tl.store(out_row + num_drafts, bonus)
        if HAS_MASK:
            bad = bad | (1 - _allowed(table_ptr, row_ids_ptr, bonus_row, bonus, W))
    if bad != 0:
        # Never hand out a token the grammar forbids: the whole output goes.
        for j in range(0, num_drafts + 1):
            tl.store(out_row + j, PLACEHOLDER)
        num_acc = 0
    tl.store(num_accepted_ptr + req, num_acc)
    tl.store(violation_ptr + req, bad)


def rejection_accept(
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64
    cu_num_draft_tokens: torch.Tensor,  # [B] int32
    draft_probs: torch.Tensor | None,  # [num_draft_tokens, V] float32
    target_probs: torch.Tensor | None,  # [num_tokens, V] float32
    temperature: torch.Tensor,  # [B] float32
    uniforms: torch.Tensor,  # [num_draft_tokens] float32
    recovered_token_ids: torch.Tensor,  # [num_tokens] int64
    max_num_drafts: int,
    mask_table: torch.Tensor | None = None,  # [num_table_rows, W] int32; None = no check
    mask_row_ids: torch.Tensor | None = None,  # [num_tokens] int32/int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # ([B, K+1] int64, num_accepted [B] int32, violation [B] bool)
    batch = cu_num_draft_tokens.shape[0]
    device = recovered_token_ids.device
    out = torch.full((batch, max_num_drafts + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int32, device=device)
    violation = torch.zeros(batch, dtype=torch.int32, device=device)
    if batch == 0:
        return out, num_accepted, violation.bool()
    probs = target_probs.contiguous().float() if target_probs is not None else None
    q = draft_probs.contiguous().float() if draft_probs is not None else None
    has_mask = mask_table is not None and mask_row_ids is not None
    table = mask_table.contiguous() if mask_table is not None and has_mask else num_accepted
    row_ids = mask_row_ids.contiguous().long() if mask_row_ids is not None and has_mask else out
    _rejection_kernel[(batch,)](
        out,
        num_accepted,
        violation,
        table,
        row_ids,
        draft_token_ids.contiguous().long(),
        cu_num_draft_tokens.contiguous().to(torch.int32),
        q if q is not None else uniforms,
        probs if probs is not None else uniforms,
        temperature.contiguous().float(),
        uniforms.contiguous().float(),
        recovered_token_ids.contiguous(),
        probs.shape[1] if probs is not None else 0,
        table.shape[1] if has_mask else 0,
        out.stride(0),
        HAS_Q=q is not None,
        HAS_PROBS=probs is not None,
        HAS_MASK=has_mask,
        PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
    )
    return out, num_accepted, violation.bool()
