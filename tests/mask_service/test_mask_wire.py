"""Compact row format: round trips, dictionary resync after lost replies, reconnects and server restarts."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceClient
from specmask.mask_service.client.row_table import RowTable
from specmask.mask_service.server.server import build_service
from specmask.mask_service.wire import (
    ALL_ONES_ID,
    ClientBeliefs,
    RowInterner,
    WireError,
    decode_row,
    encode_row,
    row_content_id,
)
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb
from tests.mask_service.service_config import make_config

SCHEMA = GrammarSpec(
    GrammarKind.JSON_SCHEMA,
    json.dumps(
        {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}, "required": ["tags"]}
    ),
)
DOC = '{"tags":["red","green blue","x"]}'


@pytest.mark.parametrize("words", [1, 5, 4008, 4009])
def test_encode_decode_round_trip(words: int) -> None:
    rng = np.random.default_rng(words)
    rows = [
        np.zeros(words, np.int32),
        np.full(words, -1, np.int32),
        rng.integers(-(2**31), 2**31, words, dtype=np.int64).astype(np.int32),
    ]
    sparse = np.zeros(words, np.int32)
    sparse[rng.integers(0, words, 3)] = -(2**31)  # only bit 31 set
    rows += [sparse, ~sparse]
    mid = np.zeros(words, np.int32)
    mid[: words // 3] = -1
    rows.append(mid)
    seen = set()
    for row in rows:
        enc, payload, allowed = encode_row(row)
        assert allowed == int(np.bitwise_count(row.view(np.uint32)).sum())
        seen.add(enc)
        out = np.empty(words, np.int32)
        decode_row(enc, payload, out)
        np.testing.assert_array_equal(out, row)
    if words >= 4008:
        assert {pb.ROW_ENCODING_ALLOWED, pb.ROW_ENCODING_FORBIDDEN, pb.ROW_ENCODING_ZLIB} <= seen


@pytest.mark.parametrize("n_ids", [0, 1, 37, 256])
def test_sparse_rows_list_every_token_in_order(n_ids: int) -> None:
    words = 4008
    rng = np.random.default_rng(n_ids)
    ids = np.sort(rng.choice(words * 32, n_ids, replace=False)).astype("<u4")
    bits = np.zeros(words * 32, np.uint8)
    bits[ids] = 1
    row = np.packbits(bits, bitorder="little").view(np.int32)  # [W]
    for r, want_enc in ((row, pb.ROW_ENCODING_ALLOWED), (~row, pb.ROW_ENCODING_FORBIDDEN)):
        enc, payload, _ = encode_row(r)
        assert enc == want_enc
        np.testing.assert_array_equal(np.frombuffer(payload, "<u4"), ids)
        out = np.empty(words, np.int32)
        decode_row(enc, payload, out)
        np.testing.assert_array_equal(out, r)


def test_interner_batches_skip_unfilled_and_share_duplicates() -> None:
    w = 64
    rng = np.random.default_rng(1)
    a, b = (rng.integers(-(2**31), 2**31, w, dtype=np.int64).astype(np.int32) for _ in range(2))
    interner = RowInterner(1 << 20)
    rows = np.stack([a, b, a, np.zeros(w, np.int32)])  # [4, W]
    got = interner.intern_rows(rows, [True, True, True, False], w)
    assert got[3] is None and got[0] is got[2] and got[0] is not got[1]
    assert got[0] is not None and got[0].row_id == row_content_id(a.tobytes(), w)
    assert len(interner) == 2
    assert interner.intern_rows(rows[1:3].copy(), [True, True], w) == [got[1], got[0]]  # hits
    # The same leading words in a wider vocabulary are a different row.
    wide = np.concatenate([a, np.zeros(1, np.int32)])
    assert interner.intern(wide, w + 1).row_id != got[0].row_id
    with pytest.raises(ValueError, match="contiguous"):
        interner.intern_rows(np.stack([a, b])[:, ::2], [True, True], w // 2)


def test_interner_is_consistent_across_threads_and_bounded() -> None:
    w = 32
    rng = np.random.default_rng(2)
    rows = rng.integers(-(2**31), 2**31, (64, w), dtype=np.int64).astype(np.int32)  # [64, W], distinct
    interner = RowInterner(1 << 20)
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda _: interner.intern_rows(rows, [True] * len(rows), w), range(8)))
    for run in runs[1:]:
        assert all(x is y for x, y in zip(run, runs[0]))  # one object per distinct row
    assert len(interner) == len(rows)
    # A small bound evicts least recently used rows; a row interned again gets the same id.
    small = RowInterner(10 * (256 + 4 * w + 64))
    ids = [small.intern(r, w).row_id for r in rows]
    assert len(small) < len(rows)
    assert small.intern(rows[0], w).row_id == ids[0]


def test_beliefs_and_table_resync() -> None:
    w = 10
    interner = RowInterner(1 << 20)
    rows = [np.arange(w, dtype=np.int32) * k for k in range(1, 4)]
    interned = [interner.intern(r, w) for r in rows]
    assert interner.intern(rows[0].copy(), w) is interned[0]  # content-addressed
    beliefs = ClientBeliefs()
    table = RowTable(w, capacity=8)
    resp = pb.DraftMasksResponse()
    beliefs.encode_response_rows("c", 1, [interned[0], None, interned[0], interned[1]], resp)
    assert len(resp.new_rows) == 2 and resp.row_ids[1] == ALL_ONES_ID
    slots = table.absorb(resp.new_rows, list(resp.row_ids))
    np.testing.assert_array_equal(table.table[slots], np.stack([rows[0], np.full(w, -1, np.int32), rows[0], rows[1]]))
    # Second response: refs only.
    resp2 = pb.DraftMasksResponse()
    beliefs.encode_response_rows("c", 1, [interned[1]], resp2)
    assert not resp2.new_rows
    # A lost reply: the server believes the client holds row 2; the client does not.
    beliefs.encode_response_rows("c", 1, [interned[2]], pb.DraftMasksResponse())
    resp3 = pb.DraftMasksResponse()
    beliefs.encode_response_rows("c", 1, [interned[2]], resp3)
    with pytest.raises(Exception, match="does not hold"):
        table.absorb(resp3.new_rows, list(resp3.row_ids))
    # New generation: full rows again.
    resp4 = pb.DraftMasksResponse()
    beliefs.encode_response_rows("c", 2, [interned[2], interned[0]], resp4)
    assert len(resp4.new_rows) == 2
    slots = table.absorb(resp4.new_rows, list(resp4.row_ids))
    np.testing.assert_array_equal(table.table[slots[0]], rows[2])


def _walk(client: MaskServiceClient, bpe_id: str, toks: list[int]) -> list[np.ndarray]:
    sid = client.open_session(bpe_id, SCHEMA)
    out = []
    for p in range(len(toks) - 2):
        res = client.draft_masks(
            [DraftMaskItem(sid, toks[p : p + 2], commit_tokens=toks[p - 1 : p] if p else [], commit_seq=p + 1)]
        )
        out.append(res[0].bitmask.numpy().copy())
    client.close_session(sid)
    return out


def test_client_resync_paths(service, bpe_id, hf_tok) -> None:
    toks = hf_tok.encode(DOC, add_special_tokens=False)
    address = f"127.0.0.1:{service.port}"
    with MaskServiceClient(address) as c1:
        expected = _walk(c1, bpe_id, toks)
        gen = c1.dict_generation
        # Client table wiped behind the server's back (as if replies were lost): resync, still exact.
        for t in c1._tables.values():
            t.clear()
        assert [np.array_equal(a, b) for a, b in zip(_walk(c1, bpe_id, toks), expected)] == [True] * len(expected)
        assert c1.dict_generation > gen
    # Reconnect as a new client: fresh dictionary, same rows.
    with MaskServiceClient(address) as c2:
        assert all(np.array_equal(a, b) for a, b in zip(_walk(c2, bpe_id, toks), expected))
    # Tiny table capacity: clears and resyncs without ever applying a wrong row.
    with MaskServiceClient(address, table_capacity=4) as c3:
        assert all(np.array_equal(a, b) for a, b in zip(_walk(c3, bpe_id, toks), expected))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_restart_keeps_client_correct(bpe_dir, registry, bpe_id, hf_tok) -> None:
    toks = hf_tok.encode(DOC, add_special_tokens=False)
    port = _free_port()
    h1 = build_service(make_config(bpe_dir, port=port), registry)
    h1.server.start()
    client = MaskServiceClient(f"127.0.0.1:{port}", deadline_s=20.0)
    try:
        expected = _walk(client, bpe_id, toks)
        h1.stop(grace_s=0.2)
        h2 = build_service(make_config(bpe_dir, port=port), registry)
        h2.server.start()
        try:
            # Same client object, same generation, new server epoch: rows resent, results exact.
            got = _walk(client, bpe_id, toks)
            assert all(np.array_equal(a, b) for a, b in zip(got, expected))
        finally:
            h2.stop(grace_s=0.2)
    finally:
        client.close()


def _new_row(row: np.ndarray, *, send_count: bool = True) -> pb.NewRow:
    enc, payload, allowed = encode_row(row)
    w = row.shape[0]
    return pb.NewRow(
        row_id=row_content_id(row.tobytes(), w),
        encoding=enc,
        payload=payload,
        allowed_count=allowed if send_count else 0,
    )


def test_table_counts_and_single_tokens_per_slot() -> None:
    w = 40
    one = np.zeros(w, np.int32)
    one[7] = 1 << 5  # token 229 only
    dense = np.random.default_rng(0).integers(-(2**31), 2**31, w, dtype=np.int64).astype(np.int32)
    rows = [one, ~one, dense]
    table = RowTable(w, capacity=8)
    slots = table.absorb([_new_row(r) for r in rows], [row_content_id(r.tobytes(), w) for r in rows])
    view = table.view()
    popcounts = [int(np.bitwise_count(r.view(np.uint32)).sum()) for r in rows]
    assert view.allowed[slots].tolist() == popcounts and view.allowed[0] == 32 * w
    assert view.single[slots].tolist() == [229, -1, -1] and view.single[0] == -1
    # A count that disagrees with the row is a corrupt response, never trusted.
    bad = _new_row(one)
    bad.allowed_count = 2
    with pytest.raises(WireError, match="allowed_count"):
        RowTable(w, capacity=8).absorb([bad], [bad.row_id])
    # The server always sends the count: a dense row without one is refused, not recounted.
    uncounted = _new_row(dense, send_count=False)
    assert uncounted.encoding not in (pb.ROW_ENCODING_ALLOWED, pb.ROW_ENCODING_FORBIDDEN)
    with pytest.raises(WireError, match="without its allowed_count"):
        RowTable(w, capacity=8).absorb([uncounted], [uncounted.row_id])


def test_table_views_survive_clear_and_growth() -> None:
    """A view's rows never change: the table appends within an epoch and a clear starts fresh arrays."""
    w = 3
    rows = [np.full(w, i, np.int32) for i in range(1, 120)]
    table = RowTable(w, capacity=100)
    table.absorb([_new_row(r) for r in rows[:2]], [])
    before = table.view()
    snapshot = before.words.copy()
    table.absorb([_new_row(r) for r in rows[2:80]], [])  # grows past the first allocation (64 rows)
    assert table.table.shape[0] == 100
    table.clear()
    table.absorb([_new_row(r) for r in rows[20:30]], [])
    np.testing.assert_array_equal(before.words, snapshot)
    assert table.view().epoch == before.epoch + 1 and table.view().source == before.source


def test_client_allowed_counts_match_real_rows(service, bpe_id, hf_tok) -> None:
    """Counts that travel with the rows equal a popcount of the real xgrammar rows (and name forced tokens)."""
    toks = hf_tok.encode(DOC, add_special_tokens=False)
    with MaskServiceClient(f"127.0.0.1:{service.port}") as client:
        sid = client.open_session(bpe_id, SCHEMA)
        singles = 0
        for p in range(len(toks)):
            commit = toks[p - 1 : p] if p else []
            (res,) = client.draft_masks([DraftMaskItem(sid, toks[p : p + 3], commit_tokens=commit, commit_seq=p + 1)])
            dense = res.bitmask.numpy()
            counts = np.bitwise_count(dense.view(np.uint32)).sum(axis=1)
            np.testing.assert_array_equal(res.rows.allowed_counts(), counts)
            for row, count in zip(res.rows, counts):
                if count == 1:
                    singles += 1
                    assert row.allows(row.single_token) and dense[0].shape == (row.view.num_mask_words,)
                else:
                    assert row.single_token is None
        assert singles > 0  # the schema forces tokens (e.g. after '{"'), so the single path is exercised


def test_row_table_maps_reply_ids_to_slots_vectorised() -> None:
    """Reply ids map to slots by one sorted search: 64-bit ids above 2**63, any order,
    repeats, ids added across replies and after a clear; an id not held is MissingRow."""
    import numpy as np

    from specmask.mask_service.client.row_table import RowTable
    from specmask.mask_service.wire import MissingRow
    from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb

    def row(i: int) -> pb.NewRow:
        payload = np.array([i], dtype="<u4").tobytes()
        return pb.NewRow(row_id=(i * 0x9E3779B97F4A7C15) % (1 << 64), encoding=pb.ROW_ENCODING_ALLOWED,
                         payload=payload, allowed_count=1)  # fmt: skip

    table = RowTable(4, 64)
    first = [row(i) for i in range(1, 6)]
    assert max(r.row_id for r in first) > 2**63
    ids = [first[3].row_id, 0, first[0].row_id, first[3].row_id]
    assert table.absorb(first, ids).tolist() == [4, 0, 1, 4]
    second = [row(i) for i in range(6, 9)]
    got = table.absorb(second, pb.DraftMasksResponse(row_ids=[second[2].row_id, first[1].row_id]).row_ids)
    assert got.tolist() == [8, 2]
    assert table.single[8] == 8
    with pytest.raises(MissingRow):
        table.absorb([], [row(99).row_id])
    table.clear()
    with pytest.raises(MissingRow):
        table.absorb([], [first[0].row_id])
    assert table.absorb([first[0]], [first[0].row_id, 0]).tolist() == [1, 0]


def test_row_table_words_come_from_the_installed_host_allocator() -> None:
    """A worker on a CUDA host installs page-locked memory for the row words; every table
    created or grown afterwards uses it, and decoding into it is unchanged."""
    import numpy as np

    from specmask.mask_service.client import row_table
    from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb

    made: list[np.ndarray] = []

    def counting(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        made.append(np.empty(shape, dtype=dtype))
        return made[-1]

    row_table.set_host_allocator(counting)
    try:
        table = row_table.RowTable(3, 200)
        assert len(made) == 1 and table.table is made[0]
        rows = [
            pb.NewRow(row_id=i, encoding=pb.ROW_ENCODING_ALLOWED, payload=np.array([i], "<u4").tobytes(),
                      allowed_count=1)
            for i in range(1, 64 + 8)
        ]  # fmt: skip
        slots = table.absorb(rows, [r.row_id for r in rows])
        assert len(made) == 2 and table.table is made[1]  # grown past the first 64 rows
        assert table.view().words[slots[5]].tolist() == [1 << 6, 0, 0]
    finally:
        row_table.set_host_allocator(None)
    assert type(row_table.RowTable(2, 8).table) is np.ndarray and len(made) == 2


@pytest.mark.parametrize("words", [1, 5, 1536, 4009])
def test_absorb_decodes_a_mixed_reply_in_bulk_exactly(words: int) -> None:
    """One reply holding every encoding (allowed and forbidden lists, zlib, dense), single-token
    rows, bit 31 set, all-zero rows and an id sent twice: the bulk decode equals the per-row
    decoder (``decode_row``) and the original rows, with the counts and single tokens of each."""
    rng = np.random.default_rng(words)
    rows = [np.zeros(words, np.int32)]
    for i in range(40):
        kind = i % 6
        if kind == 0:  # one allowed token
            row = np.zeros(words, np.int32)
            token = int(rng.integers(0, 32 * words))
            row[token // 32] = np.uint32(1 << (token % 32)).view(np.int32)
        elif kind == 1:  # a few allowed, bit 31 among them
            row = np.zeros(words, np.int32)
            row[rng.integers(0, words, 3)] = -(2**31) | 5
        elif kind == 2:  # all but a few
            row = np.full(words, -1, np.int32)
            row[rng.integers(0, words)] = ~np.int32(6)
        elif kind == 3:  # compressible dense
            row = np.zeros(words, np.int32)
            row[: max(1, words // 3)] = -1
            row[0] = 12345
        else:  # random dense
            row = rng.integers(-(2**31), 2**31, words, dtype=np.int64).astype(np.int32)
        rows.append(row)
    msgs = [_new_row(r) for r in rows]
    msgs.append(msgs[3])  # the same id twice in one reply: interned once
    table = RowTable(words, capacity=128)
    slots = table.absorb(msgs, [m.row_id for m in msgs])
    view = table.view()
    assert view.num_rows == 1 + len({m.row_id for m in msgs})
    for msg, row, slot in zip(msgs, rows, slots):
        one = np.empty(words, np.int32)
        decode_row(msg.encoding, msg.payload, one)
        np.testing.assert_array_equal(view.words[slot], one)
        np.testing.assert_array_equal(view.words[slot], row)
        count = int(np.bitwise_count(row.view(np.uint32)).sum())
        assert view.allowed[slot] == count
        if count == 1:
            word = int(np.flatnonzero(row)[0])
            assert view.single[slot] == 32 * word + (int(row[word]) & 0xFFFFFFFF).bit_length() - 1
        else:
            assert view.single[slot] == -1
    if words >= 1536:
        assert {m.encoding for m in msgs} == {
            pb.ROW_ENCODING_ALLOWED,
            pb.ROW_ENCODING_FORBIDDEN,
            pb.ROW_ENCODING_ZLIB,
            pb.ROW_ENCODING_DENSE,
        }


def test_absorb_refuses_a_corrupt_reply_without_interning_any_of_it() -> None:
    """A corrupt row anywhere in a reply (a token past the width, a dense row of the wrong
    size) fails the whole reply, and no row of it is interned: the table is as before."""
    w = 4
    good = [np.full(w, i, np.int32) for i in range(1, 4)]
    table = RowTable(w, capacity=16)
    past = pb.NewRow(row_id=77, encoding=pb.ROW_ENCODING_ALLOWED, payload=np.array([w * 32], "<u4").tobytes())
    short = pb.NewRow(row_id=78, encoding=pb.ROW_ENCODING_DENSE, payload=b"\0" * (4 * w - 4), allowed_count=40)
    for bad in (past, short):
        msgs = [_new_row(r) for r in good] + [bad]
        with pytest.raises(WireError):
            table.absorb(msgs, [m.row_id for m in msgs])
        assert table.num_rows == 1 and table.slot_of == {ALL_ONES_ID: 0}
    assert table.absorb([_new_row(good[0])], [_new_row(good[0]).row_id]).tolist() == [1]
