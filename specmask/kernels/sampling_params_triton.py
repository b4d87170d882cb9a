"""Triton kernel for `kernels.sampling_params.expand_sampling_params` (vLLM's expand_kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows written per program; requests have at most K + 1 rows and K is small.
BLOCK_ROWS = 16


@triton.jit
def _expand_kernel(
    temperature_ptr,  # [B] float32
    top_k_ptr,  # [B] int32
    top_p_ptr,  # [B] float32
    min_p_ptr,  # [B] float32 (read only when HAS_MIN_P)
    cu_ptr,  # [B] int32, cumulative k_r
    out_request_ptr,  # [num_tokens] int32
    out_temperature_ptr,  # [num_tokens] float32
    out_top_k_ptr,  # [num_tokens] int32
    out_top_p_ptr,  # [num_tokens] float32
    out_min_p_ptr,  # [num_tokens] float32 (written only when HAS_MIN_P)
    HAS_MIN_P: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    req = tl.program_id(0)
    if req == 0:
        start_draft = 0
    else:
        start_draft = tl.load(cu_ptr + req - 1)
    end_draft = tl.load(cu_ptr + req)
    first_row = start_draft + req  # rows of request r start at cu[r-1] + r
    num_rows = end_draft - start_draft + 1
    temperature = tl.load(temperature_ptr + req)
    top_k = tl.load(top_k_ptr + req)
    top_p = tl.load(top_p_ptr + req)
    min_p = 0.0
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + req)
    for block in range(0, num_rows, BLOCK_ROWS):
        offs = block + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
        live = offs < num_rows
        rows = first_row + offs
        tl.store(out_request_ptr + rows, tl.zeros([BLOCK_ROWS], tl.int32) + req, mask=live)
        tl.store(out_temperature_ptr + rows, tl.zeros([BLOCK_ROWS], tl.float32) + temperature, mask=live)
        tl.store(out_top_k_ptr + rows, tl.zeros([BLOCK_ROWS], tl.int32) + top_k, mask=live)
        tl.store(out_top_p_ptr + rows, tl.zeros([BLOCK_ROWS], tl.float32) + top_p, mask=live)
        if HAS_MIN_P:
            tl.store(out_min_p_ptr + rows, tl.zeros([BLOCK_ROWS], tl.float32) + min_p, mask=live)


def expand_sampling_params(
    temperature: torch.Tensor,  # [B] float32
    top_k: torch.Tensor,  # [B] int32
    top_p: torch.Tensor,  # [B] float32
    min_p: torch.Tensor | None,  # [B] float32, or None (off for every request: stays None)
    cu_num_draft_tokens: torch.Tensor,  # [B] int32
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns (request_index [num_tokens] int32, temperature, top_k, top_p, min_p per row)."""
    device = temperature.device
    out_request = torch.empty(num_tokens, dtype=torch.int32, device=device)
    out_temperature = torch.empty(num_tokens, dtype=torch.float32, device=device)
    out_top_k = torch.empty(num_tokens, dtype=torch.int32, device=device)
    out_top_p = torch.empty(num_tokens, dtype=torch.float32, device=device)
    out_min_p = None if min_p is None else torch.empty(num_tokens, dtype=torch.float32, device=device)
    batch = temperature.shape[0]
    if batch > 0:
        top_p_in = top_p.contiguous().float()
        _expand_kernel[(batch,)](
            temperature.contiguous().float(),
            top_k.contiguous().to(torch.int32),
            top_p_in,
            top_p_in if min_p is None else min_p.contiguous().float(),  # never read without min_p
            cu_num_draft_tokens.contiguous().to(torch.int32),
            out_request,
            out_temperature,
            out_top_k,
            out_top_p,
            out_top_p if out_min_p is None else out_min_p,  # never written without min_p
            HAS_MIN_P=min_p is not None,
            BLOCK_ROWS=BLOCK_ROWS,
        )
    return out_request, out_temperature, out_top_k, out_top_p, out_min_p
