"""Plain PyTorch reference for the accept loop of `kernels.rejection` (same
signature as `rejection_triton.rejection_accept`)."""

from __future__ import annotations

import torch

PLACEHOLDER_TOKEN_ID = -1


def rejection_accept(
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64
    cu_num_draft_tokens: torch.Tensor,  # [B] int32
    draft_probs: torch.Tensor | None,  # [num_draft_tokens, V] float32; None => q(d) = 1
    target_probs: torch.Tensor | None,  # [num_tokens, V] float32; None only if all greedy
    temperature: torch.Tensor,  # [B] float32; 0.0 = greedy
    uniforms: torch.Tensor,  # [num_draft_tokens] float32 in [0, 1)
    recovered_token_ids: torch.Tensor,  # [num_tokens] int64, kernels.recovered
    max_num_drafts: int,  # K = max k_r
    mask_table: torch.Tensor | None = None,  # [num_table_rows, W] int32 packed rows; None = no check
    mask_row_ids: torch.Tensor | None = None,  # [num_tokens] int32/int64 row of mask_table per target row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # ([B, K+1] int64, num_accepted [B] int32, violation [B] bool)
    batch = cu_num_draft_tokens.shape[0]
    device = draft_token_ids.device
    num_drafts_total = draft_token_ids.shape[0]
    cu = cu_num_draft_tokens.long()  # [B]
    num_drafts = torch.diff(cu, prepend=cu.new_zeros(1))  # [B] k_r
    start = cu - num_drafts  # [B]
    out = torch.full((batch, max_num_drafts + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)

    # Per draft: request, position, and the target row that verifies it.
    draft_req = torch.repeat_interleave(torch.arange(batch, device=device), num_drafts, output_size=num_drafts_total)
    draft_pos = torch.arange(num_drafts_total, device=device) - start[draft_req]  # [num_draft_tokens]
    target_row = torch.arange(num_drafts_total, device=device) + draft_req  # cu[r-1] + r + pos

    # Greedy rule: accept while d_i == argmax (the recovered token of a greedy row is the argmax).
    greedy_accept = draft_token_ids == recovered_token_ids[target_row]
    if target_probs is not None:
        # Leviathan et al. 2023: accept with probability min(1, p(d)/q(d)), i.e. u < p/q,
        # written u*q < p so that p = 0 (a grammar-forbidden draft) is never accepted.
        p_d = target_probs[target_row, draft_token_ids]
        q_d = (
            draft_probs[torch.arange(num_drafts_total, device=device), draft_token_ids]
            if draft_probs is not None
            else torch.ones_like(p_d)
        )
        random_accept = uniforms * q_d < p_d
        accept = torch.where(temperature[draft_req] == 0.0, greedy_accept, random_accept)
    else:
        accept = greedy_accept

    # Accepted prefix length = number of leading accepts ([B, K] layout; slots past k_r read False).
    accept_grid = torch.zeros(batch, max(max_num_drafts, 1), dtype=torch.int64, device=device)
    accept_grid[draft_req, draft_pos] = accept.long()
    num_accepted = accept_grid.cumprod(dim=1).sum(dim=1)  # [B]

    kept = draft_pos < num_accepted[draft_req]
    out[draft_req[kept], draft_pos[kept]] = draft_token_ids[kept]
    stop_row = start + torch.arange(batch, device=device) + num_accepted  # [B] recovered or bonus row
    out[torch.arange(batch, device=device), num_accepted] = recovered_token_ids[stop_row]
    violation = torch.zeros(batch, dtype=torch.bool, device=device)
    if mask_table is not None and mask_row_ids is not None:
        violation = _emitted_outside_mask(out, num_accepted, start, mask_table, mask_row_ids)
        out[violation] = PLACEHOLDER_TOKEN_ID
        num_accepted = torch.where(violation, 0, num_accepted)
    return out, num_accepted.to(torch.int32), violation


def _emitted_outside_mask(
    out: torch.Tensor,  # [B, K+1] int64 emitted tokens, then placeholders
    num_accepted: torch.Tensor,  # [B] int64; slots 0..num_accepted[r] are emitted
    start: torch.Tensor,  # [B] int64 first draft index of request r (its rows start at start + r)
    mask_table: torch.Tensor,  # [num_table_rows, W] int32
    mask_row_ids: torch.Tensor,  # [num_tokens]
) -> torch.Tensor:  # [B] bool: some emitted token is not allowed by its position's mask row
    """One bit read per emitted token (the structural on-device guarantee)."""
    batch, slots = out.shape
    num_words = mask_table.shape[1]
    pos = torch.arange(slots, device=out.device)  # [K+1]
    emitted = pos.unsqueeze(0) <= num_accepted.unsqueeze(1)  # [B, K+1]
    rows = (start + torch.arange(batch, device=out.device)).unsqueeze(1) + pos  # [B, K+1] target row
    rows = torch.where(emitted, rows, 0).clamp(max=max(mask_row_ids.shape[0] - 1, 0))
    table_rows = mask_row_ids.long()[rows]  # [B, K+1]
    word = out >> 5  # [B, K+1]
    # A token past the mask width (padded vocab) or negative is never allowed.
    in_range = (out >= 0) & (word < num_words)
    words = mask_table[table_rows, word.clamp(0, max(num_words - 1, 0))].long()  # [B, K+1]
    allowed = in_range & (((words >> (out & 31)) & 1) == 1)
    return (emitted & ~allowed).any(dim=1)
