"""Draft-side sampling (docs/design.md step 1): one draft token per request plus the
full q row that rejection sampling needs.

q must be the distribution the token was *actually* drawn from (Leviathan et
al. 2023 need q(d) and q everywhere for the recovered token), so the same
processing as the target applies: grammar mask and min_tokens stop-token
suppression (by the caller), temperature, min-p, top-k, top-p (kernels.probs). A
greedy request's draft is the argmax, so its q is one-hot: the rejection test
then accepts with probability p(d), exactly as for a proposer without a
distribution.

Sampling is the k_r = 0 case of kernels.recovered (every row is a bonus row),
with the noise stream of draft position `position`, so a seeded request
reproduces its drafts too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmask.kernels.backend import Backend, resolve_backend
from specmask.kernels.noise import draft_stream, draw_noise
from specmask.kernels.probs import logits_to_probs
from specmask.kernels.recovered import sample_recovered_tokens
from specmask.kernels.sampling_params import SamplingTensors

__all__ = ["sample_draft"]


def sample_draft(
    logits: torch.Tensor,  # [B, V] float, draft logits, already grammar-masked if masking is on
    sampling: SamplingTensors,
    *,
    position: int = 1,  # which draft d_i this is (1..K): selects a fresh noise stream
    backend: Backend | None = None,
    greedy_host: Sequence[bool] | None = None,  # [B] temperature == 0, as the caller knows it
    host_seeds: Sequence[int] | None = None,  # [B] sampling.seeds on the host (kernels.noise)
    host_steps: Sequence[int] | None = None,  # [B] sampling.step on the host
) -> tuple[torch.Tensor, torch.Tensor]:  # (tokens [B] int64, probs [B, V] float32)
    """Sample d_i for every request; returns the tokens and their normalised q rows.

    With the ``greedy_host``/``host_seeds``/``host_steps`` the caller holds, nothing is read
    back from the device; an all-greedy batch computes no probabilities (q is one-hot)."""
    if logits.dim() != 2 or logits.shape[0] != sampling.batch_size:
        raise ValueError(f"logits must be [B = {sampling.batch_size}, V], got {tuple(logits.shape)}")
    ran = resolve_backend(backend, logits.device)
    batch, vocab = logits.shape
    device = logits.device
    greedy = sampling.temperature == 0.0  # [B]
    greedy_host = list(greedy_host) if greedy_host is not None else greedy.tolist()
    probs: torch.Tensor | None = None  # [B, V]; None: every row greedy, argmax only
    if not all(greedy_host):
        probs = logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    _, inv_exp_noise = draw_noise(
        sampling.seeds,
        sampling.step,
        draft_stream(position),
        [0] * batch,
        [not g for g in greedy_host],
        vocab,
        device,
        host_seeds=host_seeds,
        host_steps=host_steps,
    )
    tokens, _ = sample_recovered_tokens(
        logits,
        probs,
        torch.empty(0, dtype=torch.int64, device=device),
        None,
        torch.zeros(batch, dtype=torch.int32, device=device),  # k_r = 0: every row is a bonus row
        torch.arange(batch, dtype=torch.int32, device=device),
        sampling.temperature,
        inv_exp_noise,
        backend=ran,
    )
    if probs is None:
        return tokens, torch.zeros(batch, vocab, dtype=torch.float32, device=device).scatter_(
            1, tokens.unsqueeze(1), 1.0
        )
    if any(greedy_host):
        one_hot = torch.zeros_like(probs).scatter_(1, tokens.unsqueeze(1), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return tokens, probs
