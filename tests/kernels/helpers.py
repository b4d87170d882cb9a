"""Shared helpers for the kernel tests (tiny fixtures, bitmask packing)."""

from __future__ import annotations

import itertools

import torch

from specmask.kernels.sampling_params import SamplingTensors


def cumulative(num_drafts: list[int]) -> torch.Tensor:  # [B] int32
    return torch.tensor(list(itertools.accumulate(num_drafts)), dtype=torch.int32)


def random_bitmask(
    num_rows: int, vocab_size: int, generator: torch.Generator, density: float = 0.5
) -> torch.Tensor:  # [num_rows, ceil(vocab_size / 32)] int32, bits >= vocab_size cleared
    allowed = torch.rand(num_rows, vocab_size, generator=generator) < density
    return pack_bitmask(allowed)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:  # [num_rows, V] bool -> [num_rows, W] int32
    num_rows, vocab_size = allowed.shape
    num_words = (vocab_size + 31) // 32
    padded = torch.zeros(num_rows, num_words * 32, dtype=torch.int64)
    padded[:, :vocab_size] = allowed.long()
    words = (padded.view(num_rows, num_words, 32) << torch.arange(32)).sum(-1)  # [num_rows, W] < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def sampling(
    temperature: list[float],
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    seeds: list[int] | None = None,
    step: list[int] | None = None,
    min_p: list[float] | None = None,
) -> SamplingTensors:
    return SamplingTensors.from_lists(temperature, top_k, top_p, seeds, step, min_p=min_p)
