"""Grammar masking of CPU logits by token ids, cached per interned mask row.

The packed-bitmask kernels (kernels.bitmask) unpack every row's 32*W bits and
rewrite all V logits of every masked row, every step. On a GPU that is one
cheap pass; on the CPU path (the reference backend) it was a visible share of
a SmolLM2 step (V = 49,152, ~40 rows), all of it grammar overhead.

A mask row is interned (mask_service.row_table: a slot of the client's table,
unchanged for its epoch's life) and real grammars reuse few distinct rows, so
this module unpacks a row once, on its first use, into the token ids that the
masking has to touch, and keeps them:

* sparse rows (at most V/2 allowed): the allowed ids. The logits row is filled
  with -inf and the allowed entries are written back (a memset plus a gather /
  scatter of the few allowed entries);
* dense rows: the disallowed ids, set to -inf;
* rows that allow every id < V (all-ones rows, rows past a stop): nothing.

The result is bit-identical to ``apply_token_bitmask_inplace`` (-inf exactly
where a bit is 0, every other entry untouched; rows must have >= V bits, as the
verifier checks: W = ceil(V / 32)). It only changes how the logits are masked; the sampler still
checks every emitted token against the packed row (kernels.rejection).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specmask.mask_service.client.row_table import MaskRow, MaskRows, as_blocks

# Bound on the token ids kept, over all cached rows (int64: 8 bytes each). A sparse or
# dense row keeps at most V/2 ids, so this holds >= 160 rows of a 128k vocabulary and,
# for real grammars (rows with a handful of allowed or disallowed ids), far more.
MAX_CACHED_IDS = 1 << 23
# The least recently used rows go first once the bound is passed.


@dataclass(frozen=True, slots=True)
class _Entry:
    sparse: bool  # True: ``ids`` are the allowed ids; False: the disallowed ids
    ids: torch.Tensor  # [n] int64 token ids < V (n = 0: the row allows every id < V)


class RowIndexCache:
    """Per interned row, the token ids masking must touch; masks CPU logits with them."""

    def __init__(self, max_ids: int = MAX_CACHED_IDS) -> None:
        self.max_ids = max_ids
        # (TableView.source, epoch, slot, V) -> entry: a slot's row never changes within its epoch.
        self._entries: OrderedDict[tuple[int, int, int, int], _Entry] = OrderedDict()
        self._num_ids = 0
        self.rows_unpacked = 0  # counter (tests): rows turned into ids, i.e. cache misses

    def _entry(self, row: MaskRow, vocab_size: int) -> _Entry:
        key = (row.view.source, row.view.epoch, row.slot, vocab_size)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        words = np.ascontiguousarray(row.words)  # [W] int32, little-endian (docs/design.md wire format)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little").view(np.bool_)  # [32 * W]
        if bits.shape[0] < vocab_size:
            raise ValueError(f"a mask row of {bits.shape[0]} bits cannot mask {vocab_size} logits")
        bits = bits[:vocab_size]  # bits >= V stand for no token
        allowed = np.flatnonzero(bits)
        if allowed.shape[0] * 2 <= vocab_size:
            entry = _Entry(True, torch.from_numpy(allowed.astype(np.int64)))
        else:
            entry = _Entry(False, torch.from_numpy(np.flatnonzero(~bits).astype(np.int64)))
        self._entries[key] = entry
        self._num_ids += entry.ids.shape[0]
        self.rows_unpacked += 1
        while self._num_ids > self.max_ids and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._num_ids -= old.ids.shape[0]
        return entry

    def mask_(self, logits: torch.Tensor, rows: Sequence[MaskRow | None]) -> None:
        """Mask ``logits`` [len(rows), V] (contiguous, on the CPU) in place: row i by
        ``rows[i]``; ``None`` = no grammar (left untouched)."""
        self.mask_blocks_(logits, as_blocks(rows))

    def mask_blocks_(self, logits: torch.Tensor, blocks: Sequence[MaskRows | int]) -> None:
        """``mask_`` for a step's rows as blocks (``DeviceMaskTable.resolve_blocks``): a
        ``MaskRows`` masks its rows, an int n leaves n rows untouched (no grammar).

        Python work per distinct row of a block (a cache lookup), not per logits row: the
        flat ids of every masked entry are built with a few vectorised index operations."""
        num_rows, vocab_size = logits.shape
        total = sum(b if isinstance(b, int) else len(b) for b in blocks)
        if num_rows != total or not logits.is_contiguous() or logits.device.type != "cpu":
            raise ValueError(f"need contiguous CPU logits [{total}, V], got {tuple(logits.shape)} {logits.device}")
        entries: list[_Entry] = []
        entry_of_row: list[np.ndarray] = []  # per block, the entry of each of its rows (-1: none)
        for block in blocks:
            if isinstance(block, int):
                entry_of_row.append(np.full(block, -1, dtype=np.int64))
                continue
            distinct, inverse = np.unique(block.slots, return_inverse=True)
            base = len(entries)
            entries.extend(self._entry(MaskRow(block.view, int(slot)), vocab_size) for slot in distinct)
            entry_of_row.append(inverse.reshape(-1).astype(np.int64) + base)
        if not entries:
            return
        which_np = np.concatenate(entry_of_row)  # [num_rows] entry per row, -1 = none
        # Which kinds of rows there are, decided on the host arrays: no tensor is read back.
        row_sparse = np.array([e.sparse for e in entries], dtype=bool)[which_np[which_np >= 0]]
        any_sparse, any_dense = bool(row_sparse.any()), bool((~row_sparse).any())
        which = torch.from_numpy(which_np)
        lengths = torch.tensor([e.ids.shape[0] for e in entries], dtype=torch.int64)  # [E]
        sparse = torch.tensor([e.sparse for e in entries], dtype=torch.bool)  # [E]
        starts = torch.cumsum(lengths, 0) - lengths  # [E] where each entry's ids begin in ``ids``
        ids = torch.cat([e.ids for e in entries])  # [Σ ids]
        has = which >= 0
        rows = torch.nonzero(has).flatten()  # [n] masked rows
        ent = which[rows]
        flat = logits.view(-1)  # [num_rows * V]

        def flat_ids(sel: torch.Tensor) -> torch.Tensor:  # rows ``rows[sel]`` -> their entries' flat ids
            r, e = rows[sel], ent[sel]
            n = lengths[e]
            row_of = torch.repeat_interleave(r, n)  # [Σ n]
            begin = torch.repeat_interleave(starts[e] - (torch.cumsum(n, 0) - n), n)
            return ids[begin + torch.arange(row_of.shape[0])] + row_of * vocab_size

        is_sparse = sparse[ent]
        if any_sparse:
            kept_ids = flat_ids(is_sparse)  # allowed entries of the sparse rows
            kept = flat.index_select(0, kept_ids)
            logits.index_fill_(0, rows[is_sparse], float("-inf"))
            flat.index_copy_(0, kept_ids, kept)
        dense = ~is_sparse
        if any_dense:
            drop = flat_ids(dense)  # disallowed entries of the dense rows
            if drop.shape[0]:
                flat.index_fill_(0, drop, float("-inf"))
