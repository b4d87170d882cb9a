"""The mask service client's interned row tables, resident on the worker's device.

Owns ``DeviceMaskTable``: a device mirror of each client ``RowTable`` (mask_service.row_table)
and the step's ``row_ids`` into it, what both bitmask kernels take; a row is uploaded once,
when it first appears. When a mirror refreshes (keyed on the table's epoch) and how rows
reach a CUDA device without a host synchronisation: docs/performance.md, "Mask rows: from
the reply to the kernel without per-row work on the step's thread".
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specmask.gpu_worker.row_index import RowIndexCache
from specmask.mask_service.client.row_table import MaskRow, MaskRows, TableView, as_blocks, set_host_allocator

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {np.dtype(np.int32): torch.int32}


def _pinned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A numpy array over page-locked memory (the tensor stays alive as the array's base)."""
    return torch.empty(shape, dtype=_TORCH_DTYPES[dtype], pin_memory=True).numpy()


def use_pinned_rows() -> None:
    """Allocate the mask client's row tables in page-locked memory from now on (CUDA hosts)."""
    set_host_allocator(_pinned_empty)


# Client tables mirrored at once: one per mask-service replica the worker's router
# talks to (and row width). Beyond it the least recently used mirror is dropped.
MAX_MIRRORS = 16


@dataclass
class _Mirror:
    epoch: int
    num_rows: int  # rows [0, num_rows) are on the device and exact
    rows: torch.Tensor  # [capacity, W] int32 on the device (on CPU: the client's table itself)


class DeviceMaskTable:
    """Device mirrors of the client row tables, and row ids into them."""

    def __init__(self, device: torch.device | str, *, zero_copy: bool | None = None) -> None:
        """``zero_copy``: share the client's numpy table instead of copying rows (None = on a
        CPU device; False on CPU runs the accelerator's upload path, which tests use)."""
        self.device = torch.device(device)
        self.zero_copy = self.device.type == "cpu" if zero_copy is None else zero_copy
        self._async = self.device.type == "cuda"
        if self._async:
            use_pinned_rows()
        # Uploads still in flight: (their CUDA event, the host rows they read).
        self._inflight: list[tuple[torch.cuda.Event, np.ndarray]] = []
        self._mirrors: OrderedDict[int, _Mirror] = OrderedDict()  # TableView.source -> mirror
        # Counters (tests, benches): rows copied host -> device, full re-uploads, stale rows gathered.
        self.rows_uploaded = 0
        self.full_uploads = 0
        self.stale_rows = 0
        # The same rows as token ids, for masking CPU logits without unpacking bits (the
        # verifier's CPU reference path); filled on first use of a row, empty on a GPU.
        self.row_index = RowIndexCache()

    def _upload(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """Copy host rows ``src`` into device rows ``dst``: asynchronous from pinned memory on a
        GPU (``src`` held until the copy is done), a plain copy elsewhere."""
        if not self._async:
            dst.copy_(torch.from_numpy(src))
            return
        self._inflight = [(e, a) for e, a in self._inflight if not e.query()]
        dst.copy_(torch.from_numpy(src), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._inflight.append((event, src))

    def _refresh(self, view: TableView) -> _Mirror:
        """Bring the mirror of ``view.source`` up to ``view`` (same or newer epoch)."""
        mirror = self._mirrors.get(view.source)
        n = view.num_rows
        if self.zero_copy:
            # Zero copy: the view's rows never change, so the mirror may share them.
            if mirror is None or view.epoch != mirror.epoch or n > mirror.num_rows:
                if mirror is None or view.epoch != mirror.epoch:
                    self.full_uploads += 1
                mirror = _Mirror(view.epoch, n, torch.from_numpy(view.words))
        elif mirror is None or view.epoch != mirror.epoch:
            rows = torch.empty((max(n, 64), view.num_mask_words), dtype=torch.int32, device=self.device)
            self._upload(rows[:n], view.words)
            mirror = _Mirror(view.epoch, n, rows)
            self.full_uploads += 1
            self.rows_uploaded += n
        elif n > mirror.num_rows:
            if n > mirror.rows.shape[0]:
                grown = torch.empty(
                    (max(n, 2 * mirror.rows.shape[0]), view.num_mask_words), dtype=torch.int32, device=self.device
                )
                grown[: mirror.num_rows].copy_(mirror.rows[: mirror.num_rows])
                mirror.rows = grown
            self._upload(mirror.rows[mirror.num_rows : n], view.words[mirror.num_rows : n])
            self.rows_uploaded += n - mirror.num_rows
            mirror.num_rows = n
        self._mirrors[view.source] = mirror
        self._mirrors.move_to_end(view.source)
        while len(self._mirrors) > MAX_MIRRORS:
            self._mirrors.popitem(last=False)
        return mirror

    def resolve(self, rows: Sequence[MaskRow | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows -> (mask_table [num_table_rows, W] int32, row_ids [len(rows)] int32), on the device.

        ``None`` stands for the all-ones row (a sequence without a grammar). At least
        one row must be a ``MaskRow``. Consecutive rows of one table epoch travel as one
        block (``resolve_blocks``)."""
        return self.resolve_blocks(as_blocks(rows))

    def resolve_blocks(self, blocks: Sequence[MaskRows | int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks of rows -> (mask_table [num_table_rows, W] int32, row_ids [Σ rows] int32).

        A block is a ``MaskRows`` (slots of one table view: a request's rows as the reply
        gave them) or an int n, n all-ones rows (a sequence without a grammar). At least
        one block must be a ``MaskRows``. The work is per block, never per row: a step's
        row ids are the blocks' slots concatenated with their mirror's offset added, in a
        few numpy operations (which release the GIL on large arrays), so a step's mask rows
        cost its launching thread a handful of calls whatever B and k are. The table is a
        mirror itself when every block comes from one client table's current epoch (the
        usual case: no copy).
        """
        # The newest view per source decides its mirror's epoch and length.
        newest: dict[int, TableView] = {}
        for block in blocks:
            if isinstance(block, int):
                continue
            v = block.view
            cur = newest.get(v.source)
            if cur is None or (v.epoch, v.num_rows) > (cur.epoch, cur.num_rows):
                newest[v.source] = v
        if not newest:
            raise ValueError("resolve() needs at least one mask row")
        offsets: dict[int, int] = {}
        parts: list[torch.Tensor] = []
        epochs: dict[int, int] = {}
        total = 0
        for source, view in newest.items():
            mirror = self._mirrors.get(source)
            if mirror is not None and view.epoch < mirror.epoch:
                continue  # every row of this source is stale: gathered below
            mirror = self._refresh(view)
            offsets[source] = total
            epochs[source] = mirror.epoch
            parts.append(mirror.rows[: mirror.num_rows])
            total += mirror.num_rows
        ones = next(iter(offsets.values()), None)  # slot 0 of any mirror is all-ones
        # Rows of an epoch the mirror has moved past: gathered from their own views (rare).
        stale: dict[tuple[int, int, int], int] = {}  # (source, epoch, slot) -> table row
        stale_rows: list[np.ndarray] = []  # [n_i, W] int32 each
        stale_base = total
        chunks: list[np.ndarray] = []  # per block, its row ids [n_block] int32
        for block in blocks:
            if isinstance(block, int):
                if ones is None:
                    ones = stale_base
                    stale_base += 1
                    stale_rows.append(np.full((1, _block_width(blocks)), -1, dtype=np.int32))
                chunks.append(np.full(block, ones, dtype=np.int32))
                continue
            v = block.view
            if epochs.get(v.source) == v.epoch:
                chunks.append(block.slots.astype(np.int32) + np.int32(offsets[v.source]))
                continue
            # Each stale row gathered once per step, however many blocks name it.
            distinct, inverse = np.unique(block.slots, return_inverse=True)
            where = np.empty(distinct.shape[0], dtype=np.int32)  # table row of each distinct slot
            for i, slot in enumerate(distinct.tolist()):
                key = (v.source, v.epoch, slot)
                if key not in stale:
                    stale[key] = stale_base
                    stale_base += 1
                    stale_rows.append(v.words[slot : slot + 1])
                where[i] = stale[key]
            chunks.append(where[inverse.reshape(-1)])
        if stale_rows:
            gathered = np.concatenate(stale_rows)
            self.stale_rows += int(gathered.shape[0])
            logger.debug("mask table: %d rows from a cleared epoch gathered on the host", gathered.shape[0])
            parts.append(torch.from_numpy(gathered).to(self.device))
        table = parts[0] if len(parts) == 1 else torch.cat(parts)
        row_ids = torch.from_numpy(np.concatenate(chunks))  # [Σ rows] int32
        if self._async:  # from the caching pinned allocator: no host synchronisation
            row_ids = row_ids.pin_memory().to(self.device, non_blocking=True)
        else:
            row_ids = row_ids.to(self.device)
        return table, row_ids


def _block_width(blocks: Sequence[MaskRows | int]) -> int:
    return next(b.view.num_mask_words for b in blocks if not isinstance(b, int))
