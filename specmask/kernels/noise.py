"""Per-request randomness, reproducible from (seed, step, stream).

Both backends must make the *same* random decisions so their outputs can be
compared token for token. Rather than a hash RNG written twice, the noise is
drawn once, in PyTorch, outside the kernels (vLLM's approach in
`rejection_sampler.py`): a `torch.Generator` per request, seeded from a
SplitMix64 mix of (seed, step, stream), so a seeded request reproduces exactly
(on the same device type: CPU and CUDA generators differ) and every step or
draft position draws fresh randomness.

Sampling from a distribution w uses the exponential race: argmax_v w_v / E_v
with E_v ~ Exp(1) i.i.d. is distributed as w / Σ w (the Gumbel-max trick in
another guise), so no normalisation and no cumsum are needed. Kernels get
1/E (`inv_exp_noise`) and *multiply*: an IEEE multiply rounds the same on every
backend, while Triton lowers fp32 division to an approximate instruction on GPU.

Streams: stream 0 is the verification step (uniforms for the accept test and
one noise row for the recovered-or-bonus token); stream 1 + i is draft
position i. A request emits at most one noise-sampled token per step (the first
rejection's recovered token or the bonus token), so all its rows can share one
noise row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["REJECTION_STREAM", "draft_stream", "draw_noise", "mix_seed"]

REJECTION_STREAM = 0

_MASK64 = (1 << 64) - 1
# Smallest E kept: 1/E must stay finite so that 0 * (1/E) is 0, never NaN.
_MIN_EXP_NOISE = torch.finfo(torch.float32).tiny


def draft_stream(position: int) -> int:
    """Stream of draft position `position` (1-based d_1..d_K; 0 allowed)."""
    return 1 + position


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, step: int, stream: int) -> int:
    """A 63-bit generator seed from (seed, step, stream); distinct inputs give unrelated streams."""
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ (step & _MASK64))
    x = _splitmix64(x ^ (stream & _MASK64))
    return x >> 1


def draw_noise(
    seeds: torch.Tensor,  # [B] int64
    steps: torch.Tensor,  # [B] int64
    stream: int,
    num_uniforms: Sequence[int],  # [B] host ints: uniforms for request r (k_r in verification)
    active: Sequence[bool],  # [B] host bools: False (greedy) -> no draws, placeholders
    vocab_size: int,
    device: torch.device,
    *,
    host_seeds: Sequence[int] | None = None,  # [B] ``seeds`` as the caller holds them on the host
    host_steps: Sequence[int] | None = None,  # [B] ``steps`` likewise
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (uniforms [Σ num_uniforms] float32 in [0, 1), inv_exp_noise [B, V] float32 = 1/E).

    Inactive requests get uniforms 0 and 1/E = 1; kernels never read them. The generators are
    seeded on the host: ``host_seeds``/``host_steps`` spare reading ``seeds``/``steps`` back from
    the device (a sync on a GPU), and a batch with no active request reads nothing.
    """
    batch = len(num_uniforms)
    if not any(active):
        return (
            torch.zeros(sum(num_uniforms), dtype=torch.float32, device=device),
            torch.ones(batch, vocab_size, dtype=torch.float32, device=device),
        )
    seeds_host = list(host_seeds) if host_seeds is not None else seeds.tolist()
    steps_host = list(host_steps) if host_steps is not None else steps.tolist()
    uniforms = torch.zeros(sum(num_uniforms), dtype=torch.float32, device=device)
    exp_noise = torch.ones(batch, vocab_size, dtype=torch.float32, device=device)
    offset = 0
    for r in range(batch):
        n = num_uniforms[r]
        if active[r]:
            gen = torch.Generator(device=device)
            gen.manual_seed(mix_seed(seeds_host[r], steps_host[r], stream))
            if n:
                uniforms[offset : offset + n] = torch.rand(n, generator=gen, device=device)
            exp_noise[r].exponential_(generator=gen)
        offset += n
    inv_exp_noise = exp_noise.clamp_min_(_MIN_EXP_NOISE).reciprocal_()
    return uniforms, inv_exp_noise
