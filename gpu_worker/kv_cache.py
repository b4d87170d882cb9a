"""Per-sequence KV cache of one model, with rollback.

Each sequence owns its own tensors, so joining, finishing and rolling back a
sequence never touches another one; the model runner pads them into a batch for
a forward and splits the new entries back out (gpu_worker.model_runner).

Invariant: ``length`` equals the number of leading tokens of the sequence
(committed tokens, possibly followed by drafts) whose keys/values are stored,
identically in every layer. Rolling back after rejected drafts is ``crop``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SequenceKV:
    """Keys and values of one sequence for one model."""

    keys: list[torch.Tensor] = field(default_factory=list)  # per layer: [1, num_kv_heads, length, head_dim]
    values: list[torch.Tensor] = field(default_factory=list)  # per layer: [1, num_kv_heads, length, head_dim]

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (a view; the next append copies anyway)."""
        if length < 0 or length > self.length:
            raise ValueError(f"cannot crop a KV cache of length {self.length} to {length}")
        if length == self.length:
            return
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]

    def set(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Replace the contents (the runner's write-back after a forward)."""
        if len(keys) != len(values) or len({k.shape[-2] for k in keys}) > 1:
            raise ValueError("inconsistent per-layer KV lengths")
        self.keys = list(keys)
        self.values = list(values)

    def free(self) -> None:
        self.keys = []
        self.values = []

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
