"""Per-request sampling parameters and their expansion to target rows (docs/design.md step 4).

A request r owns k_r + 1 consecutive target rows (its drafts' positions plus the
bonus position), starting at row cu[r-1] + r, where cu = cu_num_draft_tokens
(cumulative k_r, so k_r = 0 is one row and no padding is ever introduced).
`expand_sampling_params` broadcasts each request's parameters to its rows, so
the row-wise ops (temperature, min-p, top-k, top-p, sampling) need no ragged logic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmask.kernels.backend import Backend, resolve_backend

__all__ = ["RowSamplingParams", "SamplingTensors", "expand_sampling_params"]


@dataclass(frozen=True)
class SamplingTensors:
    """Sampling parameters, one entry per request; all tensors on the logits' device."""

    temperature: torch.Tensor  # [B] float32; 0.0 means greedy
    top_k: torch.Tensor  # [B] int32; 0 = off
    top_p: torch.Tensor  # [B] float32; 1.0 = off
    seeds: torch.Tensor  # [B] int64; per-request seed (kernels.random mixes it with `step`)
    step: torch.Tensor  # [B] int64; per-request step counter: fresh randomness every step
    # [B] float32 in [0, 1]; 0.0 = off. None: off for every request (kept optional, and last,
    # so that code building these without min_p needs no change).
    min_p: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def is_greedy(self) -> torch.Tensor:  # [B] bool
        return self.temperature == 0.0

    @staticmethod
    def from_lists(
        temperature: list[float],
        top_k: list[int] | None = None,
        top_p: list[float] | None = None,
        seeds: list[int] | None = None,
        step: list[int] | None = None,
        device: torch.device | str = "cpu",
        *,
        min_p: list[float] | None = None,
    ) -> SamplingTensors:
        """Build from host lists (the GPU worker's per-step assembly); missing fields = off / 0."""
        batch = len(temperature)
        return SamplingTensors(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k if top_k is not None else [0] * batch, dtype=torch.int32, device=device),
            top_p=torch.tensor(top_p if top_p is not None else [1.0] * batch, dtype=torch.float32, device=device),
            seeds=torch.tensor(seeds if seeds is not None else [0] * batch, dtype=torch.int64, device=device),
            step=torch.tensor(step if step is not None else [0] * batch, dtype=torch.int64, device=device),
            # None when no request filters: kernels.probs then skips the min-p pass.
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device) if min_p is not None and any(min_p) else None,
        )


@dataclass(frozen=True)
class RowSamplingParams:
    """`SamplingTensors` broadcast to target rows (k_r + 1 rows per request)."""

    request_index: torch.Tensor  # [num_tokens] int32, request r owning the row
    temperature: torch.Tensor  # [num_tokens] float32; 0.0 means greedy
    top_k: torch.Tensor  # [num_tokens] int32; 0 = off
    top_p: torch.Tensor  # [num_tokens] float32; 1.0 = off
    min_p: torch.Tensor | None  # [num_tokens] float32; 0.0 = off; None = off for every row


def expand_sampling_params(
    sampling: SamplingTensors,
    cu_num_draft_tokens: torch.Tensor,  # [B] int32, cumulative k_r
    num_tokens: int,  # Σ (k_r + 1) = cu[-1] + B
    *,
    backend: Backend | None = None,
) -> tuple[RowSamplingParams, Backend]:
    """Broadcast per-request parameters to the k_r + 1 target rows of each request."""
    if cu_num_draft_tokens.dim() != 1 or cu_num_draft_tokens.shape[0] != sampling.batch_size:
        raise ValueError(f"cu_num_draft_tokens must be [{sampling.batch_size}], got {tuple(cu_num_draft_tokens.shape)}")
    ran = resolve_backend(backend, cu_num_draft_tokens.device)
    if ran is Backend.TRITON:
        from specmask.kernels import sampling_params_triton as impl
    else:
        from specmask.kernels import sampling_params_reference as impl  # type: ignore[no-redef]  # same functions
    request_index, temperature, top_k, top_p, min_p = impl.expand_sampling_params(
        sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, cu_num_draft_tokens, num_tokens
    )
    return RowSamplingParams(request_index, temperature, top_k, top_p, min_p), ran
