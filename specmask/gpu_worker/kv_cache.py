"""KV caches of one model: a slot pool shared by all sequences, with rollback.

Every sequence's keys/values live in one row ("slot") of per-layer pool tensors
``[slots, num_kv_heads, capacity, head_dim]``. A batched forward attends
straight over a contiguous range of pool rows (a view: no per-forward copy of
anyone's past) and writes the new entries into them in place
(gpu_worker.model_runner). Slots in use are kept dense (0..n-1): freeing a slot
moves the highest one into the hole (one row copy per finished sequence), so
the rows of a batch are a contiguous range whenever the batch is everyone.

Growth is geometric and shared: when a sequence needs more positions than the
pool holds, every row grows by half (at least ``_MIN_GROWTH`` positions), and
the slot count grows by half when all slots are taken. So each row is as long as
the longest sequence's need: a static cache's memory trade for copy-free batching.
A resize zeroes and copies the whole pool (seconds for GBs on a CPU, during which
every running sequence waits), so the worker grows the pool for a whole ``add`` at
once (``grow``) instead of letting each prompt chunk that passes the capacity grow
it again.

A pool may have a byte budget (``max_bytes``, its share of the worker's KV budget:
WorkerConfig.kv_cache_bytes or gpu_memory_utilization, gpu_worker.kv_budget). Growth is
then clamped to it: the geometric part gives way first, then what the pool holds beyond
its use (slots nobody has, positions past the longest sequence: otherwise a long sequence
that has finished would leave every slot long); a resize past it raises
``KVBudgetExceeded`` instead of allocating. The worker admits a sequence only when the
pool shape the batch may come to need fits (kv_budget.KVBudget, actor._admit), so that is
a bug signal, never an out-of-memory in the middle of a step.

Rolling back after rejected drafts (``crop``) only moves ``length``; the next
write overwrites the stale entries.

Invariant: ``length`` equals the number of leading tokens of the sequence
(committed tokens, possibly followed by drafts) whose keys/values are stored,
identically in every layer, at positions ``0..length-1`` of its slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import torch

# Positions added at least when the pool grows (a step appends k + 1 at most), and the least
# capacity a pool has (kv_budget.KVBudget.min_capacity).
_MIN_GROWTH = 64
MIN_CAPACITY = _MIN_GROWTH


class KVBudgetExceeded(RuntimeError):
    """A pool resize past the pool's byte budget."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one position of one sequence takes in a pool: keys and values of every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On a CPU, from calloc (numpy's zeros): the kernel hands out zero pages
    and backs them on first write, so a resize costs the copy of the rows in use, not a pass
    over the whole new pool (a GB took over a second here while every stream waited); the
    pool's untouched capacity costs no memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = torch.empty((), dtype=dtype).element_size()
    raw = {1: numpy.uint8, 2: numpy.uint16, 4: numpy.uint32, 8: numpy.uint64}[size]
    return torch.from_numpy(numpy.zeros(shape, dtype=raw)).view(dtype)


class SlotPool:
    """Per-layer KV tensors ``[slots, H, capacity, D]`` of one model, shared by its sequences."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        max_bytes: int | None = None,
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.bytes_per_position = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        self.max_bytes = max_bytes  # None = unbounded
        self.k: list[torch.Tensor] = []  # per layer: [slots, H, capacity, D]
        self.v: list[torch.Tensor] = []
        self._owners: list[SequenceKV] = []  # slot i -> its sequence; dense: slots 0..len-1 are in use

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    @property
    def num_used(self) -> int:
        return len(self._owners)

    def owner(self, slot: int) -> SequenceKV:
        return self._owners[slot]

    def fits(self, slots: int, capacity: int) -> bool:
        """Whether a pool of ``slots`` x ``capacity`` positions stays within the budget."""
        return self.max_bytes is None or slots * capacity * self.bytes_per_position <= self.max_bytes

    def _resize(self, slots: int, capacity: int) -> None:
        if not self.fits(slots, capacity):
            raise KVBudgetExceeded(
                f"a KV pool of {slots} slots x {capacity} positions "
                f"({slots * capacity * self.bytes_per_position} bytes) exceeds its budget of {self.max_bytes} bytes"
            )
        shape = (slots, self.num_kv_heads, capacity, self.head_dim)
        # Zeros, not empty: a forward reads every position of its rows up to the batch's end (the
        # mask hides the ones past a row's own length), and masked-out garbage NaNs would still
        # poison the output (0 * NaN); everything written later is a finite model output.
        with torch.inference_mode():
            new_k = [_zeros(shape, self.dtype, self.device) for _ in range(self.num_layers)]
            new_v = [_zeros(shape, self.dtype, self.device) for _ in range(self.num_layers)]
            used = len(self._owners)
            keep = min(self.capacity, capacity)
            for dst, src in zip((*new_k, *new_v), (*self.k, *self.v), strict=False):
                dst[:used, :, :keep] = src[:used, :, :keep]
        self.k, self.v = new_k, new_v

    def bind(self, kv: SequenceKV) -> None:
        """Give ``kv`` the lowest free slot (growing the slot count if none is free)."""
        if kv.pool is not None:
            raise ValueError("this KV cache already has a slot")
        if len(self._owners) == self.num_slots:
            self.grow(self.num_slots + 1, 0)
        kv.pool, kv.slot = self, len(self._owners)
        self._owners.append(kv)

    def release(self, kv: SequenceKV) -> None:
        """Free ``kv``'s slot; the highest slot in use moves into it so slots stay dense."""
        slot = kv.slot
        if kv.pool is not self or slot is None or self._owners[slot] is not kv:
            raise ValueError("this KV cache has no slot in this pool")
        last = len(self._owners) - 1
        if slot != last:
            moved = self._owners[last]
            with torch.inference_mode():
                for t in (*self.k, *self.v):
                    t[slot, :, : moved.length] = t[last, :, : moved.length]
            self._owners[slot] = moved
            moved.slot = slot
        self._owners.pop()
        kv.pool, kv.slot = None, None

    def grow(self, slots: int, positions: int, *, step: int = 1) -> None:
        """At least ``slots`` slots and ``positions`` positions per slot, in at most one resize;
        each grows geometrically (slots by half, positions by half and at least ``_MIN_GROWTH``,
        rounded up to a multiple of ``step``), or straight to what is asked if that is more.
        Under a budget, the first of these shapes that fits: the geometric one; the slots asked
        with the geometric capacity; the slots asked with what is asked; then, shrinking, the
        slots in use and the positions the longest sequence holds (never less than asked)."""
        exact_slots = max(slots, self.num_slots, 1)
        new_slots = self.num_slots
        if slots > new_slots:
            new_slots = max(slots, new_slots + max(1, new_slots // 2))
        capacity = self.capacity
        if positions > capacity:
            capacity = max(positions, capacity + max(capacity // 2, _MIN_GROWTH))
            capacity = -(-capacity // step) * step
        capacity = max(capacity, _MIN_GROWTH)
        asked = max(positions, self.capacity, _MIN_GROWTH)
        floor = max(slots, self.num_used, 1), max(positions, self._longest(), _MIN_GROWTH)
        shape = self._first_fit([(max(new_slots, 1), capacity), (exact_slots, capacity), (exact_slots, asked), floor])
        if shape != (self.num_slots, self.capacity):
            self._resize(*shape)

    def ensure_slots(self, slots: int) -> None:
        """At least ``slots`` slots (used or free): a static-shape forward spans a whole bucket of
        them. Under a budget, the capacity may shrink to the longest sequence's to make room."""
        if slots > self.num_slots:
            capacity = max(self.capacity, _MIN_GROWTH)
            shape = self._first_fit([(slots, capacity), (slots, max(self._longest(), _MIN_GROWTH))])
            self._resize(*shape)

    def _longest(self) -> int:
        """Positions the longest sequence in the pool holds."""
        return max((kv.length for kv in self._owners), default=0)

    def _first_fit(self, shapes: Sequence[tuple[int, int]]) -> tuple[int, int]:
        """The first (slots, capacity) within the budget, else the last (whose resize raises)."""
        return next((shape for shape in shapes if self.fits(*shape)), shapes[-1])

    def reserve(self, positions: int, *, step: int = 1, slots: int = 0) -> None:
        """Room for ``positions`` positions in every slot (``grow``), keeping at least ``slots``
        slots (a static forward's bucket) and the ones in use."""
        self.grow(slots, positions, step=step)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class SequenceKV:
    """One sequence's handle on a ``SlotPool``: its slot and how many positions are filled.

    A handle gets its slot from the model runner at its first forward. ``append`` on a
    handle with no slot makes a private one-slot pool (tests, tools)."""

    def __init__(self) -> None:
        self.pool: SlotPool | None = None
        self.slot: int | None = None
        self.length = 0

    @property
    def pool_slot(self) -> int:
        """The slot in its pool; only asked of a handle the runner has placed."""
        assert self.slot is not None, "the KV handle has no slot yet"
        return self.slot

    @property
    def keys(self) -> list[torch.Tensor]:  # per layer: [1, num_kv_heads, length, head_dim] views
        return [k[:, :, : self.length] for k in self.buffers()[0]]

    @property
    def values(self) -> list[torch.Tensor]:  # per layer: [1, num_kv_heads, length, head_dim] views
        return [v[:, :, : self.length] for v in self.buffers()[1]]

    @property
    def capacity(self) -> int:
        return self.pool.capacity if self.pool is not None else 0

    def buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This slot's whole per-layer rows (``[1, H, capacity, D]`` views into the pool)."""
        if self.pool is None or self.slot is None:
            return [], []
        s = self.slot
        return [k[s : s + 1] for k in self.pool.k], [v[s : s + 1] for v in self.pool.v]

    def reserve(self, extra: int, like: torch.Tensor | None = None, num_layers: int | None = None) -> None:
        """Room for ``extra`` more positions. A handle without a slot gets a private pool shaped
        from ``like`` (any ``[*, H, *, D]`` tensor of this model) and ``num_layers``."""
        if self.pool is None:
            if like is None or num_layers is None:
                raise ValueError("the first reserve needs a template tensor and a layer count")
            SlotPool(num_layers, like.shape[1], like.shape[3], dtype=like.dtype, device=like.device).bind(self)
        assert self.pool is not None
        self.pool.reserve(self.length + extra)

    def advance(self, extra: int) -> None:
        """Count ``extra`` positions written in place past ``length`` (see model_runner)."""
        if self.length + extra > self.capacity:
            raise ValueError(f"advance by {extra} past capacity {self.capacity} (length {self.length})")
        self.length += extra

    def append(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Append per-layer ``[1, H, T, D]`` entries at ``length`` (growing the pool if needed)."""
        if len(keys) != len(values) or len({k.shape[-2] for k in (*keys, *values)}) > 1:
            raise ValueError("inconsistent per-layer KV lengths")
        if self.pool is not None and len(keys) != self.pool.num_layers:
            raise ValueError(f"expected {self.pool.num_layers} layers, got {len(keys)}")
        extra = keys[0].shape[-2]
        self.reserve(extra, keys[0], len(keys))
        end = self.length + extra
        k_rows, v_rows = self.buffers()
        with torch.inference_mode():
            for dst, src in zip((*k_rows, *v_rows), (*keys, *values), strict=True):
                dst[:, :, self.length : end] = src
        self.length = end

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (no copy: later writes overwrite the rest)."""
        if length < 0 or length > self.length:
            raise ValueError(f"cannot crop a KV cache of length {self.length} to {length}")
        self.length = length

    def free(self) -> None:
        if self.pool is not None:
            self.pool.release(self)
        self.length = 0

    def nbytes(self) -> int:
        """Bytes of this sequence's slot (spare capacity included)."""
        if self.pool is None or not self.pool.num_slots:
            return 0
        return self.pool.nbytes() // self.pool.num_slots
