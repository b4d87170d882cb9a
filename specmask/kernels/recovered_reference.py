"""Plain PyTorch reference for `kernels.recovered.sample_recovered_tokens`."""

from __future__ import annotations

import torch


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
    device = target_logits.device
    req = request_index.long()  # [num_tokens]
    cu = cu_num_draft_tokens.long()  # [B]
    start = cu - torch.diff(cu, prepend=cu.new_zeros(1))  # [B] first draft index of r
    rows = torch.arange(num_tokens, device=device)  # [num_tokens]
    pos = rows - start[req] - req  # [num_tokens] position within the request
    is_draft_row = pos < (cu - start)[req]  # [num_tokens]; False on the bonus row
    draft_idx = (start[req] + pos).clamp(max=max(draft_token_ids.shape[0] - 1, 0))  # [num_tokens]

    # Greedy: argmax of the masked logits (torch.argmax returns the first maximum).
    greedy_tokens = target_logits.argmax(dim=-1)  # [num_tokens]
    if target_probs is None:
        return greedy_tokens

    # q on the rows being verified; zero on bonus rows so that w = p there.
    q = torch.zeros(num_tokens, vocab, dtype=torch.float32, device=device)  # [num_tokens, V]
    draft_rows = rows[is_draft_row]
    if draft_rows.numel():
        if draft_probs is not None:
            q[draft_rows] = draft_probs[draft_idx[draft_rows]].float()
        else:
            q[draft_rows, draft_token_ids[draft_idx[draft_rows]]] = 1.0
    inv = inv_exp_noise[req]  # [num_tokens, V]
    residual = (target_probs - q).clamp_min(0.0)  # [num_tokens, V]
    # Scores restricted to w > 0 (-1 elsewhere) so a p = 0 token can never win.
    residual_score = torch.where(residual > 0, residual * inv, -1.0)
    target_score = torch.where(target_probs > 0, target_probs * inv, -1.0)
    residual_tokens = residual_score.argmax(dim=-1)  # first maximum on ties
    residual_any = residual_score.amax(dim=-1) >= 0  # False: max(0, p - q) is all zero
    target_tokens = target_score.argmax(dim=-1)
    random_tokens = torch.where(residual_any, residual_tokens, target_tokens)
    return torch.where(temperature[req] == 0.0, greedy_tokens, random_tokens)
