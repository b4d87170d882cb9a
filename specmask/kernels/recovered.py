"""The token a request emits when verification stops at a given target row.

Terms (defined once, used everywhere in `kernels/`):
* **accepted** draft: d_i kept by the rejection test; 0-based target rows
  0..k_r-1 of a request verify d_1..d_k, row k_r only yields the bonus token;
* **recovered** token: emitted at the first rejected row i < k_r, sampled from
  normalise(max(0, p_i - q_i)) (Leviathan et al. 2023, Algorithm 1), where
  q_i = one-hot(d_i) when the proposer gave no distribution (q = 1 at d_i), so
  the recovered token is p_i with d_i removed;
* **bonus** token: emitted at row k_r when all k_r drafts were accepted, sampled
  from p_{k_r} (with k_r = 0 this is a plain decoding step).
Greedy requests use argmax(logits row) for both (lowest index on ties).

This op computes that candidate for *every* target row at once (vLLM's
`sample_recovered_tokens`): rows are independent and the rejection kernel then
only picks one per request. Sampling uses the exponential race with the
request's noise row (kernels.noise); restricted to w > 0 so a token with p = 0
(grammar-masked) can never be emitted, and if max(0, p - q) is all zero
(p == q exactly, or underflow) the row falls back to sampling p itself.

`kernels.draft_sampling` reuses it with k_r = 0 for every request: then every
row is a bonus row, i.e. plain (greedy or random) sampling.
"""

from __future__ import annotations

import torch

from specmask.kernels.backend import Backend, resolve_backend

__all__ = ["sample_recovered_tokens"]


def sample_recovered_tokens(
    target_logits: torch.Tensor,  # [num_tokens, V] float, grammar-masked (greedy argmax)
    target_probs: torch.Tensor | None,  # [num_tokens, V] float32 (None only if all greedy)
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64
    draft_probs: torch.Tensor | None,  # [num_draft_tokens, V] float32; None => q = one-hot(d)
    cu_num_draft_tokens: torch.Tensor,  # [B] int32, cumulative k_r
    request_index: torch.Tensor,  # [num_tokens] int32, request owning each row
    temperature: torch.Tensor,  # [B] float32; 0.0 = greedy
    inv_exp_noise: torch.Tensor,  # [B, V] float32, 1/E with E ~ Exp(1)
    *,
    backend: Backend | None = None,
) -> tuple[torch.Tensor, Backend]:  # ([num_tokens] int64, backend that ran)
    """Recovered token for draft rows, bonus token for each request's last row."""
    ran = resolve_backend(backend, target_logits.device)
    if ran is Backend.TRITON:
        from specmask.kernels import recovered_triton as impl
    else:
        from specmask.kernels import recovered_reference as impl  # type: ignore[no-redef]  # same functions
    tokens = impl.sample_recovered_tokens(
        target_logits,
        target_probs,
        draft_token_ids,
        draft_probs,
        cu_num_draft_tokens,
        request_index,
        temperature,
        inv_exp_noise,
    )
    return tokens, ran
