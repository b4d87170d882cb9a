"""Plain PyTorch reference for `kernels.sampling_params.expand_sampling_params`."""

from __future__ import annotations

import torch


def expand_sampling_params(
    temperature: torch.Tensor,  # [B] float32
    top_k: torch.Tensor,  # [B] int32
    top_p: torch.Tensor,  # [B] float32
    min_p: torch.Tensor | None,  # [B] float32, or None (off for every request: stays None)
    cu_num_draft_tokens: torch.Tensor,  # [B] int32
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns (request_index [num_tokens] int32, temperature, top_k, top_p, min_p per row)."""
    batch = temperature.shape[0]
    cu = cu_num_draft_tokens.long()  # [B]
    num_drafts = torch.diff(cu, prepend=cu.new_zeros(1))  # [B] k_r
    rows_per_request = num_drafts + 1  # [B]
    request_index = torch.repeat_interleave(
        torch.arange(batch, device=cu.device), rows_per_request, output_size=num_tokens
    )  # [num_tokens]
    return (
        request_index.to(torch.int32),
        temperature.index_select(0, request_index),
        top_k.index_select(0, request_index),
        top_p.index_select(0, request_index),
        None if min_p is None else min_p.index_select(0, request_index),
    )
