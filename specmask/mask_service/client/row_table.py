"""The client's interned mask rows: one packed int32 table per row width, and views of it.

Every mask row the service sends is decoded once into a slot of a ``RowTable``
(content id -> slot; slot 0 is the all-ones row). Everything downstream names a
row by its slot: the worker's grammar-forced and draft checks read the per-slot
allowed count, and the bitmask kernels index a device mirror of the same table
(``gpu_worker.mask_table.DeviceMaskTable``), so a row is never copied into a
dense per-request tensor on the way from the reply to the kernel.

Lifetime rule that makes this safe across threads: within an *epoch* a table
only appends (slot s, once written, never changes), and ``clear`` starts the
next epoch in fresh arrays instead of overwriting. So a ``TableView`` (rows
[0, num_rows) of one epoch) stays valid, with exact rows, for as long as anyone
holds it, however the table changes meanwhile on a mask-reply thread.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from specmask.mask_service.wire import ALL_ONES_ID, MissingRow, WireError
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb

# Allocates a table's host arrays: (shape, dtype) -> an empty array. np.empty by default; a
# worker on a CUDA host installs page-locked memory (gpu_worker.mask_table.use_pinned_rows),
# so uploading new rows to the device mirror is an asynchronous DMA straight from the table
# the mask-reply thread decoded them into (rows never change within an epoch, so the copy
# can run while that thread appends more).
HostAllocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]


def _numpy_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


_host_allocator: HostAllocator = _numpy_empty


def set_host_allocator(allocator: HostAllocator | None) -> None:
    """Allocate the row words of every table created or grown from now on with ``allocator``
    (None: np.empty)."""
    global _host_allocator
    _host_allocator = allocator if allocator is not None else _numpy_empty


def _empty(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return _host_allocator(shape, np.dtype(dtype))


# Distinct per RowTable in this process: a device mirror is keyed by it.
_SOURCES = itertools.count(1)
# First allocation (rows); the table doubles up to its capacity.
_INITIAL_ROWS = 64


@dataclass(frozen=True, slots=True, eq=False)
class TableView:
    """Rows [0, num_rows) of one RowTable epoch: immutable (see the module note)."""

    source: int  # which RowTable (one per client and row width)
    epoch: int  # bumps on every clear of that table
    words: np.ndarray  # [num_rows, W] int32
    allowed: np.ndarray  # [num_rows] int32 set bits per slot (all W*32 bits; slot 0 = W*32)
    single: np.ndarray  # [num_rows] int32 the token of the one set bit where allowed == 1, else -1

    @property
    def num_rows(self) -> int:
        return int(self.words.shape[0])

    @property
    def num_mask_words(self) -> int:
        return int(self.words.shape[1])


@dataclass(frozen=True, slots=True)
class MaskRow:
    """One mask row: a slot of a table view. Host questions answered without a popcount."""

    view: TableView
    slot: int

    @property
    def allowed_count(self) -> int:
        """Set bits of the row (padding bits >= V included: rows past the stop are all-ones)."""
        return int(self.view.allowed[self.slot])

    @property
    def single_token(self) -> int | None:
        """The token id when the row allows exactly one token, else None (may be >= V)."""
        token = int(self.view.single[self.slot])
        return None if token < 0 else token

    def forced_token(self, vocab_size: int) -> int | None:
        """The token id if the row allows exactly one token and it is < vocab_size, else None.

        A row whose only other set bits are padding (>= V) is not reported: it is never a
        grammar's row (padding ids are never allowed), and missing a forced position costs
        only a draft."""
        token = self.single_token
        return token if token is not None and token < vocab_size else None

    @property
    def words(self) -> np.ndarray:  # [W] int32 (a read-only view)
        return self.view.words[self.slot]

    def allows(self, token_id: int) -> bool:
        """Whether bit ``token_id`` is set."""
        word = token_id >> 5
        if not 0 <= word < self.view.num_mask_words:
            return False
        return bool((int(self.view.words[self.slot, word]) >> (token_id & 31)) & 1)


@dataclass(frozen=True, slots=True, eq=False)
class MaskRows:
    """The rows of one request in a reply, as slots of a table view (no copy)."""

    view: TableView
    slots: np.ndarray  # [n] int32

    def __len__(self) -> int:
        return int(self.slots.shape[0])

    def __getitem__(self, i: int) -> MaskRow:
        return MaskRow(self.view, int(self.slots[i]))

    def __iter__(self) -> Iterator[MaskRow]:
        view = self.view
        return (MaskRow(view, int(s)) for s in self.slots)

    def dense(self) -> np.ndarray:  # [n, W] int32, a copy
        return self.view.words[self.slots]

    def allowed_counts(self) -> np.ndarray:  # [n] int32
        return self.view.allowed[self.slots]

    @staticmethod
    def join(head: Sequence[MaskRow], tail: MaskRows | None = None) -> MaskRows | None:
        """``head`` then ``tail`` as one block of slots, or None when they do not share one
        table epoch (the caller then keeps them row by row). Views of one epoch differ only
        in length, and a table only appends within an epoch, so the longest view holds
        every slot of the others, with the same rows."""
        if tail is not None:
            view = tail.view
        elif head:
            view = head[0].view
        else:
            return None
        for row in head:
            v = row.view
            if v is view:  # rows of one reply share its view: the usual case
                continue
            if v.source != view.source or v.epoch != view.epoch:
                return None
            if v.words.shape[0] > view.words.shape[0]:
                view = v
        slots = np.fromiter((r.slot for r in head), dtype=np.int32, count=len(head))  # [len(head)]
        if tail is not None:
            slots = np.concatenate([slots, tail.slots.astype(np.int32, copy=False)])
        return MaskRows(view, slots)


def as_blocks(rows: Sequence[MaskRow | None]) -> list[MaskRows | int]:
    """Rows -> blocks: each run of consecutive rows of one table epoch as one ``MaskRows``,
    each run of ``None`` (no grammar: the all-ones row) as its length."""
    blocks: list[MaskRows | int] = []
    run: list[MaskRow] = []

    def flush() -> None:
        if run:
            block = MaskRows.join(run)
            assert block is not None  # one epoch by construction
            blocks.append(block)
            run.clear()

    for row in rows:
        if row is None:
            flush()
            if blocks and isinstance(blocks[-1], int):
                blocks[-1] += 1
            else:
                blocks.append(1)
            continue
        if run and (row.view.source, row.view.epoch) != (run[0].view.source, run[0].view.epoch):
            flush()
        run.append(row)
    flush()
    return blocks


def _single_set_bit(words: np.ndarray) -> int:  # [W] int32 with exactly one bit set -> its token id
    word = int(np.flatnonzero(words)[0])
    return 32 * word + (int(words[word]) & 0xFFFFFFFF).bit_length() - 1


class RowTable:
    """Client-side interned rows: a packed int32 table plus content id -> slot.

    ``view()`` is what a kernel (through a device mirror) indexes; slot 0 is
    always the all-ones row. When the table is full it is cleared (next epoch)
    and the client's generation bumps, which tells the server to resend.
    Not thread-safe: the client mutates it under its lock; views need no lock.
    """

    def __init__(self, num_mask_words: int, capacity: int) -> None:
        if capacity < 2:
            raise ValueError("capacity must be >= 2")
        self.num_mask_words = num_mask_words
        self.capacity = capacity
        self.source = next(_SOURCES)
        self.epoch = 0
        self.clear()

    def clear(self) -> None:
        """Start the next epoch in fresh arrays: views of the old epoch stay intact."""
        size = min(self.capacity, _INITIAL_ROWS)
        self.table = _empty((size, self.num_mask_words), np.int32)  # [rows, W]
        self.allowed = np.empty(size, dtype=np.int32)  # [rows]
        self.single = np.empty(size, dtype=np.int32)  # [rows]
        self.ids = np.empty(size, dtype=np.uint64)  # [rows] content id of each slot
        self.table[0] = -1
        self.allowed[0] = 32 * self.num_mask_words
        self.single[0] = -1
        self.ids[0] = ALL_ONES_ID
        self.slot_of: dict[int, int] = {ALL_ONES_ID: 0}
        self.num_rows = 1
        self.epoch += 1
        # Content ids sorted, with their slots: a reply's ids map to slots in one vectorised
        # search (no Python work per id). Rebuilt when rows were added since.
        self._sorted_ids = self.ids[:1].copy()
        self._sorted_slots = np.zeros(1, dtype=np.int32)

    def _grow(self, need: int) -> None:
        size = self.table.shape[0]
        if need <= size:
            return
        new_size = min(self.capacity, max(need, size * 2))
        n = self.num_rows
        grown = _empty((new_size, self.num_mask_words), np.int32)
        grown[:n] = self.table[:n]
        allowed = np.empty(new_size, dtype=np.int32)
        allowed[:n] = self.allowed[:n]
        single = np.empty(new_size, dtype=np.int32)
        single[:n] = self.single[:n]
        ids = np.empty(new_size, dtype=np.uint64)
        ids[:n] = self.ids[:n]
        # New arrays, old ones untouched: views taken before the growth stay valid.
        self.table, self.allowed, self.single, self.ids = grown, allowed, single, ids

    def has_room(self, n: int) -> bool:
        return self.num_rows + n <= self.capacity

    def view(self) -> TableView:
        n = self.num_rows
        return TableView(self.source, self.epoch, self.table[:n], self.allowed[:n], self.single[:n])

    def _decode_fresh(self, fresh: Sequence[pb.NewRow], start: int) -> None:
        """Decode ``fresh`` (distinct ids, none held) into slots [start, start + n): words,
        allowed count and single token, a few numpy operations per reply rather than per row.

        Sparse rows (allowed / forbidden token lists) become one flat array of (slot, token)
        bits OR-ed into zeroed words in one ``bitwise_or.at``; dense and zlib rows are joined
        and copied in one assignment (``zlib.decompress`` releases the GIL on large buffers).
        Counts: sparse encodings carry the count as their length; dense ones (> SPARSE_MAX_TOKENS
        either way, so never single) use the server's ``allowed_count``, which the server always
        sends (a dense row without one is a corrupt response)."""
        n = len(fresh)
        w = self.num_mask_words
        total = 32 * w
        out = self.table[start : start + n]  # [n, W] int32
        # Per row, only attribute reads of the reply's message (no numpy call per row).
        encodings = np.fromiter((r.encoding for r in fresh), dtype=np.int64, count=n)  # [n]
        payloads = [r.payload for r in fresh]
        sent = np.fromiter((r.allowed_count for r in fresh), dtype=np.int64, count=n)  # [n] 0 = not sent
        lengths = np.fromiter((len(b) for b in payloads), dtype=np.int64, count=n)  # [n] bytes
        allowed_enc = encodings == pb.ROW_ENCODING_ALLOWED
        forbidden_enc = encodings == pb.ROW_ENCODING_FORBIDDEN
        sparse = allowed_enc | forbidden_enc
        dense = (encodings == pb.ROW_ENCODING_DENSE) | (encodings == pb.ROW_ENCODING_ZLIB)
        if not bool((sparse | dense).all()):
            raise WireError(f"unknown row encoding {int(encodings[~(sparse | dense)][0])}")
        counts = np.where(allowed_enc, lengths // 4, np.where(forbidden_enc, total - lengths // 4, sent))
        missing = dense & (sent == 0)
        if bool(missing.any()):
            row_id = fresh[int(np.flatnonzero(missing)[0])].row_id
            raise WireError(f"row {row_id:#x}: a dense row without its allowed_count")
        wrong = (sent != 0) & (sent != counts)
        if bool(wrong.any()):
            i = int(np.flatnonzero(wrong)[0])
            raise WireError(f"row {fresh[i].row_id:#x}: allowed_count {sent[i]} but the row has {counts[i]} tokens")

        if bool(sparse.any()):
            idx = np.flatnonzero(sparse)  # [m] rows of ``fresh``
            if bool((lengths[idx] % 4).any()):
                raise WireError("a sparse row's payload is not a whole number of token ids")
            tokens = np.frombuffer(b"".join(payloads[i] for i in idx), dtype="<u4")  # [Σ ids]
            if tokens.size and int(tokens.max()) >= total:
                raise WireError("sparse row names a token beyond the row width")
            owner = np.repeat(np.arange(idx.size), lengths[idx] // 4)  # [Σ ids] sparse row of each id
            bits = np.zeros((idx.size, w), dtype=np.uint32)  # the sparse rows' words, unsigned for the OR
            flat = owner * w + (tokens >> 5)
            np.bitwise_or.at(bits.reshape(-1), flat, np.left_shift(np.uint32(1), tokens & np.uint32(31)))
            forbid = np.flatnonzero(forbidden_enc[idx])
            bits[forbid] = ~bits[forbid]
            out[idx] = bits.view(np.int32)
        if bool(dense.any()):
            idx = np.flatnonzero(dense)
            blobs = [zlib.decompress(payloads[i]) if encodings[i] == pb.ROW_ENCODING_ZLIB else payloads[i] for i in idx]
            sizes = np.fromiter((len(b) for b in blobs), dtype=np.int64, count=len(blobs))
            if bool((sizes != 4 * w).any()):
                bad = int(sizes[sizes != 4 * w][0])
                raise WireError(f"dense row has {bad} bytes, expected {4 * w}")
            out[idx] = np.frombuffer(b"".join(blobs), dtype="<i4").reshape(len(idx), w)

        self.allowed[start : start + n] = counts
        single = np.full(n, -1, dtype=np.int32)
        one = counts == 1
        if bool(one.any()):
            # Single-token rows: mostly sparse allowed lists (the id is the payload); any other
            # encoding (a tiny vocabulary) is read from its decoded words.
            for row in np.flatnonzero(one).tolist():
                if allowed_enc[row]:
                    single[row] = int(np.frombuffer(payloads[row], dtype="<u4")[0])
                else:
                    single[row] = _single_set_bit(out[row])
        self.single[start : start + n] = single

    def absorb(self, new_rows: Sequence[pb.NewRow], row_ids: Sequence[int]) -> np.ndarray:
        """Intern ``new_rows`` and map ``row_ids`` to slots. Returns [num_rows] int32 slots.

        Raises MissingRow if an id is neither held nor sent.
        """
        fresh: list[pb.NewRow] = []
        fresh_ids: dict[int, None] = {}
        for r in new_rows:
            row_id = r.row_id
            if row_id not in self.slot_of and row_id not in fresh_ids:  # an id sent twice in one reply: once
                fresh_ids[row_id] = None
                fresh.append(r)
        if not self.has_room(len(fresh)):
            raise MissingRow("row table full")
        if fresh:
            start = self.num_rows
            self._grow(start + len(fresh))
            self._decode_fresh(fresh, start)
            self.ids[start : start + len(fresh)] = np.fromiter(fresh_ids, dtype=np.uint64, count=len(fresh))
            self.slot_of.update(zip(fresh_ids, range(start, start + len(fresh))))
            self.num_rows = start + len(fresh)
        return self.slots_of(row_ids)

    def slots_of(self, row_ids: Sequence[int]) -> np.ndarray:
        """Slots of ``row_ids`` ([n] int32), by a vectorised search of the sorted ids (the
        reply's repeated field is converted by numpy in one call, not id by id in Python).
        Raises MissingRow if an id is not held."""
        n = self.num_rows
        if self._sorted_slots.shape[0] != n:
            order = np.argsort(self.ids[:n], kind="stable")
            self._sorted_ids, self._sorted_slots = self.ids[:n][order], order.astype(np.int32)
        wanted = np.array(row_ids, dtype=np.uint64).reshape(-1)  # [n]
        pos = np.searchsorted(self._sorted_ids, wanted)
        np.minimum(pos, n - 1, out=pos)
        if not np.array_equal(self._sorted_ids[pos], wanted):
            raise MissingRow("response references a row this client does not hold")
        return self._sorted_slots[pos]
