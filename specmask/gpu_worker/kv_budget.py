"""The worker's KV memory budget: its size, and whether a batch of sequences fits in it.

Every sequence's keys and values live in one slot of its model's pool, and every slot is
as long as the longest (gpu_worker.kv_cache): a batch of n sequences takes
``slots(n) x max(need)`` slot-positions, whatever the other sequences' lengths. So a
sequence reserves, from its admission to its end, the positions it may come to hold:
its prompt plus its ``max_tokens`` (capped at the context), plus ``slack`` positions a
forward may write past its last token (the drafts of a verify row, a static forward's
padding), and the batch fits while ``slots(n) x max(need)`` stays within the budget. A
sequence admitted under that rule never makes a pool grow past its budget: no
out-of-memory and no refused resize in the middle of a step, whatever lengths the
sequences reach. The orchestrator places a request on a worker only where it fits
(orchestrator.placement, from ``WorkerInfo.kv_budget``), so one that does not waits in the queue
while the running ones go on; the worker checks again at ``add`` (actor._admit).

Pure Python (no torch): the orchestrator imports it with gpu_worker.types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Device memory kept out of the KV budget on CUDA beside what is allocated when the budget is
# sized (weights, the CUDA context): activations of a step and of a prefill chunk, and the
# CUDA graphs' memory pool. An estimate, not a profile: vLLM measures a dummy forward instead.
ACTIVATION_RESERVE_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class KVBudget:
    """A worker's KV budget in slot-positions, and the pool shape rule admission follows."""

    positions: int  # slot-positions the pools may hold (a position: one token's KV in every model)
    max_model_len: int  # the worker's longest sequence, prompt and output (a need never passes it)
    slack: int  # positions past a sequence's last token a forward may write
    min_capacity: int  # the pool's least positions per slot (kv_cache.MIN_CAPACITY)
    # Slot counts a static forward pads its batch to (static_forward.BATCH_BUCKETS where it pads,
    # on a GPU); () = a batch of n takes n slots. Past the largest bucket, n slots.
    slot_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.positions < 1 or self.slack < 0 or self.min_capacity < 1:
            raise ValueError(f"bad KV budget {self}")
        if self.slots(1) * self.need(self.max_model_len, 0) > self.positions:
            raise ValueError(f"a KV budget of {self.positions} positions holds no {self.max_model_len}-token sequence")

    def need(self, prompt_len: int, max_tokens: int) -> int:
        """Positions per slot a sequence may come to need: its longest extent and the slack."""
        return max(self.min_capacity, min(prompt_len + max_tokens, self.max_model_len) + self.slack)

    def slots(self, n: int) -> int:
        """Slots a pool of ``n`` sequences may take (a static forward's bucket of them)."""
        return next((b for b in self.slot_buckets if b >= n), n)

    def reserved(self, needs: Sequence[int]) -> int:
        """Slot-positions a batch with these needs may come to take (0 for none)."""
        return self.slots(len(needs)) * max(needs) if needs else 0

    def fits(self, needs: Sequence[int]) -> bool:
        return self.reserved(needs) <= self.positions

    def usage(self, needs: Sequence[int]) -> float:
        """The fraction of the budget a batch with these needs reserves (0..1 when it fits)."""
        return self.reserved(needs) / self.positions


def longest_sequence(positions: int, *, slack: int, min_capacity: int, slot_buckets: Sequence[int] = ()) -> int:
    """The longest sequence (prompt and output) that fits a budget of ``positions`` alone;
    below 1 when none does."""
    one = next((b for b in slot_buckets if b >= 1), 1)
    per_slot = positions // one
    return per_slot - slack if per_slot >= min_capacity else 0


def budget_bytes(
    *,
    kv_cache_bytes: int | None,
    gpu_memory_utilization: float | None,
    device_type: str,
    total_bytes: int = 0,
    free_bytes: int = 0,
    reserve_bytes: int = ACTIVATION_RESERVE_BYTES,
) -> int | None:
    """The KV budget in bytes (None = unbounded). ``kv_cache_bytes`` is taken as it is, on any
    device. ``gpu_memory_utilization`` (CUDA only) is vLLM's: the fraction of the device's
    memory this worker may use, of which what is already in use when the models have loaded
    (``total_bytes - free_bytes``: weights, the CUDA context, other processes) and
    ``reserve_bytes`` for activations are not KV. Raises ValueError when that leaves nothing."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    if gpu_memory_utilization is None:
        return None
    if device_type != "cuda":
        raise ValueError(
            f"--gpu-memory-utilization sizes the KV budget from CUDA device memory; the device is {device_type!r}: "
            "give --kv-cache-bytes instead"
        )
    in_use = total_bytes - free_bytes
    kv = int(total_bytes * gpu_memory_utilization) - in_use - reserve_bytes
    if kv <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {gpu_memory_utilization:g} of {total_bytes / 1024**3:.1f} GiB leaves no KV "
            f"memory: {in_use / 1024**3:.1f} GiB are in use after loading the models and "
            f"{reserve_bytes / 1024**3:.1f} GiB are kept for activations"
        )
    return kv
