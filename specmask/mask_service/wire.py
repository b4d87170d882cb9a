"""Compact wire format for bitmask rows: a content-addressed row dictionary.

Why: a dense Llama-3 row is 16,032 bytes, yet most rows repeat an earlier row
exactly and many allow (or forbid) only a handful of tokens. So every row is
named by a **content id** (64 bits of sha256 over the row width and bytes;
id 0 is reserved for the all-ones row) and the response carries

* ``row_ids``: one fixed64 per row (8 bytes), and
* ``new_rows``: the content of every id the server does not believe the client
  already holds, in the smallest of: allowed-token list, forbidden-token list,
  zlib-compressed dense, dense.

Correctness across reconnects and restarts (never apply a wrong row):

* Ids are content hashes, so a row id the client holds always decodes to the
  right bits, whichever server process or epoch sent it. There is no shared
  counter to get out of sync.
* The server's *belief* about what a client holds is keyed by
  ``(client_id, dict_generation)``; forgetting a belief (server restart, LRU
  bound) only costs bytes: rows are resent in full.
* If the belief is wrong the other way (a response was lost, or responses of
  concurrent calls arrived out of order, or the client cleared its table), the
  client finds an id it does not hold, bumps its generation and retries the
  call. Retrying is safe because commits are idempotent by sequence number and
  masks do not change committed state. On a generation change the server
  drops its belief and resends every row.

Server side (``RowInterner``, ``ClientBeliefs``) needs only numpy and xxhash; the client
side (``mask_service.row_table.RowTable``) decodes with numpy into a packed int32
table that a GPU kernel can index (``apply_token_bitmask_indirect_inplace``).
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from xxhash import xxh3_128_intdigest

from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb

ALL_ONES_ID = 0
# Rows allowing/forbidding at most this many tokens travel as a uint32 id list
# (4 bytes/token); above it zlib of the dense row is smaller for typical masks.
SPARSE_MAX_TOKENS = 256
# zlib level 1: several times faster than the default and within a few % of its size on
# mask rows (long runs of 0x00 / 0xff); compression runs once per distinct row.
ZLIB_LEVEL = 1


def row_content_id(row_bytes: bytes, num_mask_words: int) -> int:
    """64-bit content id of a dense row (never 0, which means all-ones)."""
    h = hashlib.sha256(num_mask_words.to_bytes(4, "little") + row_bytes).digest()
    return int.from_bytes(h[:8], "little") or 1


def _set_bit_ids(words: np.ndarray) -> np.ndarray:
    """Token ids whose bit is set, ascending. words: [W] uint32 -> [n] <u4.

    Unpacks only the non-zero words: a sparse row has few, so this costs
    little where unpacking all W*32 bits would touch the whole vocabulary.
    """
    nz = np.flatnonzero(words)
    bits = np.unpackbits(words[nz].astype("<u4").view(np.uint8), bitorder="little").reshape(nz.size, 32)
    ids = nz[:, None] * 32 + np.arange(32)  # [n_words, 32]
    return ids[bits.astype(bool)].astype("<u4")


def encode_row(row: np.ndarray) -> tuple[pb.RowEncoding.ValueType, bytes, int]:
    """Pick the smallest encoding for one dense row. row: [W] int32.

    Returns (encoding, payload, allowed_count): the popcount is needed to pick
    the encoding anyway, and travels as ``NewRow.allowed_count`` so the client
    knows grammar-forced rows (count 1) without counting again.
    """
    bits = row.view(np.uint32)
    allowed = int(np.bitwise_count(bits).sum())
    total = bits.size * 32
    if allowed <= SPARSE_MAX_TOKENS:
        return pb.ROW_ENCODING_ALLOWED, _set_bit_ids(bits).tobytes(), allowed
    if total - allowed <= SPARSE_MAX_TOKENS:
        return pb.ROW_ENCODING_FORBIDDEN, _set_bit_ids(~bits).tobytes(), allowed
    dense = row.astype("<i4", copy=False).tobytes()
    packed = zlib.compress(dense, ZLIB_LEVEL)
    if len(packed) < len(dense):
        return pb.ROW_ENCODING_ZLIB, packed, allowed
    return pb.ROW_ENCODING_DENSE, dense, allowed


def decode_row(encoding: int, payload: bytes, out: np.ndarray) -> None:
    """Write one row into ``out`` ([W] int32) from its wire encoding."""
    if encoding == pb.ROW_ENCODING_DENSE or encoding == pb.ROW_ENCODING_ZLIB:
        data = zlib.decompress(payload) if encoding == pb.ROW_ENCODING_ZLIB else payload
        if len(data) != out.size * 4:
            raise WireError(f"dense row has {len(data)} bytes, expected {out.size * 4}")
        out[:] = np.frombuffer(data, dtype="<i4")
        return
    ids = np.frombuffer(payload, dtype="<u4")
    if ids.size and int(ids.max()) >= out.size * 32:
        raise WireError("sparse row names a token beyond the row width")
    bits = np.zeros(out.size * 32, dtype=np.uint8)
    bits[ids] = 1
    words = np.packbits(bits, bitorder="little").view("<i4")
    if encoding == pb.ROW_ENCODING_ALLOWED:
        out[:] = words
    elif encoding == pb.ROW_ENCODING_FORBIDDEN:
        out[:] = ~words
    else:
        raise WireError(f"unknown row encoding {encoding}")


class WireError(Exception):
    """A response that cannot be decoded (corrupt or from an incompatible server)."""


class MissingRow(WireError):
    """The server referenced a row id this client does not hold: resync and retry."""


@dataclass(frozen=True, slots=True)
class InternedRow:
    row_id: int  # wire content id (sha256-based, the same in every server process)
    encoding: int
    payload: bytes
    allowed_count: int  # set bits of the row (all W*32 bits, padding included)


# Accounting per interned row beyond its payload: the OrderedDict entry, the
# 128-bit int key, the InternedRow and the payload's bytes object (measured ~250;
# rounded up).
_ROW_OVERHEAD_BYTES = 384


class RowInterner:
    """Server-wide table of distinct rows seen recently, with their chosen encoding.

    Shared by all clients and sessions: the encoding work (popcount, sparse
    extraction, zlib) is done once per distinct row, not once per occurrence.
    Bounded by bytes, LRU.

    Lookup is by a keyed 128-bit XXH3 of the row bytes, read straight from the
    engine's buffer. It replaced a sampled-key bucket plus a compare of the
    whole row against the stored copy: that compare read 16 KB from memory per
    Llama-3 row with the GIL held, the largest Python cost
    on the hot path. Two distinct rows share a key with probability ~2^-128.
    XXH3 is not a cryptographic hash, but its seed is a per-process secret,
    which makes a collision hard to aim at. The wire's own 64-bit content ids
    are the weaker link, not this table.
    """

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._bytes = 0
        self._lock = threading.Lock()
        self._seed = int.from_bytes(os.urandom(8), "little")
        self._rows: OrderedDict[int, InternedRow] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def intern(self, row: np.ndarray, num_mask_words: int) -> InternedRow:
        """row: [W] int32 (C-contiguous)."""
        (interned,) = self.intern_rows(row[None], [True], num_mask_words)
        assert interned is not None
        return interned

    def intern_rows(self, rows: np.ndarray, filled: Sequence[bool], num_mask_words: int) -> list[InternedRow | None]:
        """Intern every filled row of ``rows`` ([n, W] int32, C-contiguous); None where not filled.

        Thread-safe. Hashing and encoding of new rows happen outside the lock.
        """
        if not rows.flags.c_contiguous:
            raise ValueError("rows must be C-contiguous")
        seed = self._seed ^ num_mask_words  # rows of different widths never share a key
        keys = [xxh3_128_intdigest(rows[i], seed) if f else None for i, f in enumerate(filled)]
        out: list[InternedRow | None] = [None] * len(keys)
        missing: dict[int, list[int]] = {}  # key -> indices into rows
        with self._lock:
            get, touch = self._rows.get, self._rows.move_to_end
            for i, key in enumerate(keys):
                if key is None:
                    continue
                hit = get(key)
                if hit is None:
                    missing.setdefault(key, []).append(i)
                else:
                    touch(key)
                    out[i] = hit
        if not missing:
            return out
        fresh = {}
        for key, idx in missing.items():
            row = rows[idx[0]]
            encoding, payload, allowed = encode_row(row)
            fresh[key] = InternedRow(row_content_id(row.tobytes(), num_mask_words), encoding, payload, allowed)
        with self._lock:
            for key, new in fresh.items():
                interned = self._rows.get(key)  # another thread may have won the race
                if interned is None:
                    interned = self._rows[key] = new
                    self._bytes += len(new.payload) + _ROW_OVERHEAD_BYTES
                for i in missing[key]:
                    out[i] = interned
            while self._bytes > self._max and len(self._rows) > 1:
                _, old = self._rows.popitem(last=False)
                self._bytes -= len(old.payload) + _ROW_OVERHEAD_BYTES
        return out


# Per-client belief bound: forgetting is always safe (rows get resent).
MAX_BELIEF_ROWS_PER_CLIENT = 8192
MAX_CLIENTS = 1024


class ClientBeliefs:
    """What the server believes each (client_id, generation) already holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: OrderedDict[str, tuple[int, OrderedDict[int, None]]] = OrderedDict()

    def held_set(self, client_id: str, generation: int) -> OrderedDict[int, None]:
        """The (mutable) belief set for this client; a new generation starts empty."""
        with self._lock:
            cur = self._clients.get(client_id)
            if cur is None or cur[0] != generation:
                cur = (generation, OrderedDict())
                self._clients[client_id] = cur
            self._clients.move_to_end(client_id)
            while len(self._clients) > MAX_CLIENTS:
                self._clients.popitem(last=False)
            return cur[1]

    def encode_response_rows(
        self, client_id: str, generation: int, rows: list[InternedRow | None], response: pb.DraftMasksResponse
    ) -> None:
        """Fill ``row_ids`` and ``new_rows``. ``None`` in rows means all-ones."""
        if not client_id:
            held: OrderedDict[int, None] = OrderedDict()  # anonymous client: always full rows
        else:
            held = self.held_set(client_id, generation)
        ids: list[int] = []
        sent: set[int] = set()
        with self._lock:
            for r in rows:
                if r is None:
                    ids.append(ALL_ONES_ID)
                    continue
                ids.append(r.row_id)
                if r.row_id in held:
                    held.move_to_end(r.row_id)
                    continue
                if r.row_id in sent:
                    continue
                sent.add(r.row_id)
                response.new_rows.add(
                    row_id=r.row_id, encoding=r.encoding, payload=r.payload, allowed_count=r.allowed_count
                )
                held[r.row_id] = None
            while len(held) > MAX_BELIEF_ROWS_PER_CLIENT:
                held.popitem(last=False)
        response.row_ids.extend(ids)
