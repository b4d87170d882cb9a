"""Sampling parameters applied to logits: temperature, min-p, top-k, top-p -> probabilities.

This is the "p" (and, on the draft side, "q") of Leviathan et al. 2023: the
distributions rejection sampling compares are the *processed* ones, so the
target and the draft go through this same function (docs/design.md step 4).

Order, as vLLM's sampler (``vllm/v1/sample/sampler.py``, ``Sampler.sample``):
temperature, then min-p (its argmax-invariant logits processor), then top-k and
top-p. The grammar mask comes before all of them (the caller's), so min-p's
"most likely token" is the most likely *allowed* one.

Deliberately one PyTorch implementation shared by both backends, as in vLLM's
sampler (`apply_top_k_top_p`): top-p needs a sort, which a Triton kernel would
only re-implement, and sharing it makes the Triton and reference paths see
bit-identical probabilities, so their outputs can be compared exactly.
"""

from __future__ import annotations

import torch

__all__ = ["apply_min_p", "apply_top_k_top_p", "logits_to_probs"]


def apply_min_p(
    logits: torch.Tensor,  # [num_rows, V] float32, temperature-scaled; modified in place
    min_p: torch.Tensor,  # [num_rows] float32 in [0, 1]; 0 = off
) -> torch.Tensor:  # logits, with tokens below min_p * max_prob at -inf
    """vLLM's min-p: drop tokens whose probability is below ``min_p`` times the row's largest.
    The largest survives for any min_p <= 1 (ties with it too), so a row never empties;
    a row with min_p = 0 compares against 0 and keeps every token."""
    probs = logits.softmax(dim=-1)  # [num_rows, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [num_rows, 1]
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, V] float32, not modified
    top_k: torch.Tensor,  # [num_rows] int32; 0 = off
    top_p: torch.Tensor,  # [num_rows] float32; 1.0 = off
) -> torch.Tensor:  # [num_rows, V] float32, filtered tokens at -inf
    """vLLM's sort-based filter: keep the top-k values (ties with the k-th kept),
    then the smallest set whose probability mass reaches top_p (always >= 1 token)."""
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k.long(), vocab).clamp(max=vocab)  # [num_rows]
    # Stable sort: ties between equal logits are ordered the same way on every run.
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False, stable=True)  # [num_rows, V]
    kth_largest = logits_sort.gather(1, (vocab - k).unsqueeze(1))  # [num_rows, 1]
    logits_sort = logits_sort.masked_fill(logits_sort < kth_largest, float("-inf"))
    cum_probs = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # [num_rows, V], ascending order
    drop = cum_probs <= (1.0 - top_p).unsqueeze(1)  # [num_rows, V]
    drop[:, -1] = False  # the most likely token always survives
    logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits_sort).scatter_(1, logits_idx, logits_sort)


def logits_to_probs(
    logits: torch.Tensor,  # [num_rows, V] float (grammar-masked), not modified
    temperature: torch.Tensor,  # [num_rows] float32; 0.0 = greedy (treated as 1.0 here)
    top_k: torch.Tensor,  # [num_rows] int32; 0 = off
    top_p: torch.Tensor,  # [num_rows] float32; 1.0 = off
    min_p: torch.Tensor | None = None,  # [num_rows] float32; 0.0 = off; None = off for every row
) -> torch.Tensor:  # [num_rows, V] float32, rows sum to 1
    """softmax(top_k_top_p(min_p(logits / T))). Greedy rows get T = 1 only to stay finite:
    the greedy rule decides on argmax(logits) and never reads their probabilities."""
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))  # [num_rows]
    scaled = logits.float() / scale.unsqueeze(1)  # [num_rows, V], a fresh tensor
    if min_p is not None:
        # The caller passes None when no row filters (SamplingTensors.from_lists): no sync here.
        scaled = apply_min_p(scaled, min_p)
    # Skipping the O(V log V) sort when no row filters is worth one host sync.
    if bool(((top_k > 0) | (top_p < 1.0)).any()):
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    return _finite_or_masked_argmax(scaled.softmax(dim=-1), logits)


def _finite_or_masked_argmax(
    probs: torch.Tensor,  # [num_rows, V] float32, modified in place
    logits: torch.Tensor,  # [num_rows, V] float, the grammar-masked logits before processing
) -> torch.Tensor:  # [num_rows, V] float32, every row finite and summing to 1
    """Rows whose processed distribution is not finite become one-hot at the masked argmax.

    A denormal temperature (1e-40) turns logits / T into +-inf,
    softmax into NaN, and the exponential race then picks token 0 (often EOS)
    *whatever the mask says*. The T -> 0 limit of softmax(l / T) is the argmax, so
    the fallback is also the right distribution. NaN logits are skipped (-inf) so
    the argmax stays on an allowed token; a row with no allowed finite logit at all
    yields token 0, which the rejection sampler's mask check then reports. Sync-free:
    a where over the rows instead of a host-side branch.
    """
    bad = ~torch.isfinite(probs).all(dim=-1)  # [num_rows]
    safe = torch.where(torch.isnan(logits), float("-inf"), logits.float())  # [num_rows, V]
    best = safe.argmax(dim=-1, keepdim=True)  # [num_rows, 1]
    probs.masked_fill_(bad.unsqueeze(1), 0.0)
    at_best = torch.where(bad.unsqueeze(1), 1.0, probs.gather(1, best))  # [num_rows, 1]
    return probs.scatter_(1, best, at_best)
