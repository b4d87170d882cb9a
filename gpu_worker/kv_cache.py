"""Per-sequence KV cache of one model, with rollback.

Each sequence owns its own buffers, so joining, finishing and rolling back a
sequence never touches another one; the model runner pads them into a batch for
a forward and appends the new entries back (gpu_worker.model_runner).

Buffers have spare capacity (grown by half, at least ``_MIN_GROWTH`` positions,
when full): appending a step's few new entries writes them in place instead of
concatenating, and so copying, the whole cache every forward. Rolling back
after rejected drafts (``crop``) only moves ``length``; the next append
overwrites the stale entries.

Invariant: ``length`` equals the number of leading tokens of the sequence
(committed tokens, possibly followed by drafts) whose keys/values are stored,
identically in every layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Positions added at least when a buffer grows (a step appends k + 1 at most).
_MIN_GROWTH = 64


class SequenceKV:
    """Keys and values of one sequence for one model."""

    def __init__(self) -> None:
        self._k: list[torch.Tensor] = []  # per layer: [1, num_kv_heads, capacity, head_dim]
        self._v: list[torch.Tensor] = []  # per layer: [1, num_kv_heads, capacity, head_dim]
        self.length = 0

    @property
    def keys(self) -> list[torch.Tensor]:  # per layer: [1, num_kv_heads, length, head_dim] views
        return [k[:, :, : self.length] for k in self._k]

    @property
    def values(self) -> list[torch.Tensor]:  # per layer: [1, num_kv_heads, length, head_dim] views
        return [v[:, :, : self.length] for v in self._v]

    @property
    def capacity(self) -> int:
        return self._k[0].shape[2] if self._k else 0

    def buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The whole per-layer buffers (``[1, H, capacity, D]``), for writing in place."""
        return self._k, self._v

    def reserve(self, extra: int, like: torch.Tensor | None = None, num_layers: int | None = None) -> None:
        """Room for ``extra`` more positions. New buffers take head count, head dim, dtype
        and device from ``like`` (any ``[*, H, *, D]`` tensor of this model) and ``num_layers``,
        which only the first allocation needs: later ones copy the current buffers' shape."""
        need = self.length + extra
        if need <= self.capacity:
            return
        if like is None or num_layers is None:
            if not self._k:
                raise ValueError("the first reserve needs a template tensor and a layer count")
            like, num_layers = self._k[0], len(self._k)
        cap = max(need, self.capacity + max(self.capacity // 2, _MIN_GROWTH))
        shape = (1, like.shape[1], cap, like.shape[3])
        new_k = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(num_layers)]
        new_v = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(num_layers)]
        for dst, src in zip((*new_k, *new_v), (*self._k, *self._v), strict=False):
            dst[:, :, : self.length] = src[:, :, : self.length]
        self._k, self._v = new_k, new_v

    def advance(self, extra: int) -> None:
        """Count ``extra`` positions written in place past ``length`` (see model_runner)."""
        if self.length + extra > self.capacity:
            raise ValueError(f"advance by {extra} past capacity {self.capacity} (length {self.length})")
        self.length += extra

    def append(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Append per-layer ``[1, H, T, D]`` entries at ``length`` (growing the buffers if needed)."""
        if len(keys) != len(values) or len({k.shape[-2] for k in (*keys, *values)}) > 1:
            raise ValueError("inconsistent per-layer KV lengths")
        if self._k and len(keys) != len(self._k):
            raise ValueError(f"expected {len(self._k)} layers, got {len(keys)}")
        extra = keys[0].shape[-2]
        self.reserve(extra, keys[0], len(keys))
        end = self.length + extra
        for dst, src in zip((*self._k, *self._v), (*keys, *values), strict=True):
            dst[:, :, self.length : end] = src
        self.length = end

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (no copy: later appends overwrite the rest)."""
        if length < 0 or length > self.length:
            raise ValueError(f"cannot crop a KV cache of length {self.length} to {length}")
        self.length = length

    def free(self) -> None:
        self._k, self._v = [], []
        self.length = 0

    def nbytes(self) -> int:
        """Bytes held, spare capacity included."""
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))
