"""Mask rows in one form: row ids into the device-resident row table give exactly what dense rows give."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from specmask.gpu_worker.mask_table import DeviceMaskTable
from specmask.gpu_worker.types import SpeculationParams
from specmask.kernels.backend import Backend
from specmask.kernels.bitmask import apply_token_bitmask_indirect_inplace, apply_token_bitmask_inplace
from specmask.kernels.rejection import rejection_sample
from specmask.mask_service.client.row_table import RowTable
from tests.gpu_worker import test_greedy_equivalence
from tests.gpu_worker.helpers import table_rows
from tests.gpu_worker.test_greedy_equivalence import _check, _run
from tests.kernels.helpers import cumulative, random_bitmask, sampling

V = 1000  # W = 32 words, last one partial
W = (V + 31) // 32
references = test_greedy_equivalence.references  # the plain constrained greedy reference (module fixture)


def _dense(rows, ones) -> torch.Tensor:  # [n, W] int32: what the removed dense path stacked per step
    return torch.stack([ones if r is None else torch.from_numpy(r.words.copy()) for r in rows])


@pytest.mark.parametrize("backend", [Backend.REFERENCE, Backend.TRITON])
@pytest.mark.parametrize("zero_copy", [True, False])
def test_indirect_table_matches_dense_rows(backend, zero_copy):
    """Masked logits and rejection-sampled tokens are bit-identical to the dense path."""
    g = torch.Generator().manual_seed(7)
    distinct = random_bitmask(6, V, g, density=0.3)
    # Repeats, an all-ones row and a single-token row, as real replies have.
    distinct[5] = 0
    distinct[5, 3] = 1 << 4
    picks = [0, 1, 1, 2, 5, 3, 0, 4, 4, 2]
    mask_rows = table_rows(distinct[picks])
    # Four requests: k = 2, 0 (no grammar), 3, 1 -> 3 + 1 + 4 + 2 target rows.
    k = [2, 0, 3, 1]
    rows = [*mask_rows[0:3], None, *mask_rows[3:7], *mask_rows[7:9]]
    ones = torch.full((W,), -1, dtype=torch.int32)
    dense = _dense(rows, ones)

    table = DeviceMaskTable("cpu", zero_copy=zero_copy)
    mask_table, row_ids = table.resolve(rows)
    assert mask_table.shape[0] < len(rows)  # interned: repeats share a table row
    if zero_copy:
        assert table.rows_uploaded == 0
    logits = torch.randn(len(rows), V, generator=g) * 3
    direct, indirect = logits.clone(), logits.clone()
    apply_token_bitmask_inplace(direct, dense, backend=backend)
    apply_token_bitmask_indirect_inplace(indirect, mask_table, row_ids, backend=backend)
    assert torch.equal(direct, indirect)

    # Drafts drawn from the masked rows (some rejected by the target), greedy and random requests.
    drafts = []
    offset = 0
    for r, kr in enumerate(k):
        for i in range(kr):
            allowed = torch.nonzero(torch.isfinite(direct[offset + i])).flatten()
            drafts.append(int(allowed[(r + i) % len(allowed)]))
        offset += kr + 1
    draft_ids = torch.tensor(drafts, dtype=torch.int64)
    params = sampling([0.0, 0.8, 1.0, 0.0], seeds=[1, 2, 3, 4], step=[5, 6, 7, 8])
    dense_ids = torch.arange(len(rows), dtype=torch.int32)
    want = rejection_sample(
        draft_ids, cumulative(k), None, direct, params, mask_table=dense, mask_row_ids=dense_ids, backend=backend
    )
    got = rejection_sample(
        draft_ids, cumulative(k), None, indirect, params, mask_table=mask_table, mask_row_ids=row_ids, backend=backend
    )
    assert got.backend is backend
    for name in ("output_token_ids", "num_emitted", "num_accepted", "violation"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert not bool(got.violation.any())


def test_mirror_refresh_across_epochs():
    """Incremental upload within an epoch, full re-upload after a clear, and rows a step still
    holds from the cleared epoch resolved from their own (intact) view."""
    g = torch.Generator().manual_seed(3)
    dense = random_bitmask(6, V, g)
    source = RowTable(W, capacity=4)
    mirror = DeviceMaskTable("cpu", zero_copy=False)  # the accelerator's upload path

    a, b = table_rows(dense[0:2], source)  # epoch 1: slots 1, 2
    mirror.resolve([a, b])
    assert (mirror.full_uploads, mirror.rows_uploaded) == (1, 3)
    (c,) = table_rows(dense[2:3], source)  # slot 3: only it is uploaded
    mirror.resolve([c, None])
    assert (mirror.full_uploads, mirror.rows_uploaded) == (1, 4)

    source.clear()  # the client's table filled up: epoch 2 reuses slots 1..
    d, e = table_rows(dense[3:5], source)
    assert d.slot == a.slot and e.slot == b.slot
    rows = [a, d, None, c, e, a]
    got_table, ids = mirror.resolve(rows)
    expected = _dense(rows, torch.full((W,), -1, dtype=torch.int32))
    assert torch.equal(got_table[ids.long()], expected)
    assert (mirror.full_uploads, mirror.stale_rows) == (2, 2)  # a and c gathered once each
    # Only stale rows (no current-epoch row at all) still resolve.
    got_table, ids = mirror.resolve([c])
    assert torch.equal(got_table[ids.long()], expected[3:4])


def test_worker_outputs_exact_when_the_client_table_clears_mid_run(make_worker, references, monkeypatch):
    """Greedy worker output equals plain constrained decoding with a client row table so small
    that it clears during the run, mirrored through the upload path (as on a GPU)."""
    from specmask.mask_service.client import router
    from specmask.mask_service.client.mask_client import MaskServiceClient

    monkeypatch.setattr(router, "MaskServiceClient", functools.partial(MaskServiceClient, table_capacity=24))
    worker = make_worker()
    worker.mask_table.zero_copy = False
    spec = SpeculationParams(k=4, proposers=("draft_model", "grammar_forced"), draft_masking=True)
    _check(_run(lambda **_: worker, references, spec), references)
    assert worker.mask_table.full_uploads > 1  # the client's table was cleared and re-mirrored
    assert worker.mask_table.rows_uploaded > 0
    client = next(iter(worker.masks._router._clients.values()))
    assert max(t.epoch for t in client._tables.values()) > 1
    assert np.all([t.num_rows <= 24 for t in client._tables.values()])


def test_mirror_is_keyed_on_the_table_epoch_not_the_dictionary_generation(tiny_pair, mask_address):
    """A row-dictionary resync (real gRPC) bumps the client's generation (``table_generation``)
    but keeps its table: same epoch, rows append-only, so every mirrored row is still exact.
    The mirror then uploads only the rows the resync added (keyed on the generation it would
    re-upload everything); a clear, which does change the rows, still re-uploads everything."""
    from transformers import AutoTokenizer

    from specmask.common.grammar_spec import GrammarKind, GrammarSpec
    from specmask.common.tokenizer_id import tokenizer_id_for_path
    from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceClient

    tok_id = tokenizer_id_for_path(tiny_pair[0])
    hf = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    spec = GrammarSpec(
        GrammarKind.JSON_SCHEMA,
        '{"type":"object","properties":{"aa":{"type":"integer"},"bb":{"type":"string"}},"required":["aa","bb"]}',
    )
    drafts = list(hf.encode('{"aa":12,"bb":"x', add_special_tokens=False))
    with MaskServiceClient(mask_address, deadline_s=60.0) as a, MaskServiceClient(mask_address, deadline_s=60.0) as b:
        sa, sb = a.open_session(tok_id, spec), b.open_session(tok_id, spec)
        first = a.draft_masks([DraftMaskItem(sa, drafts[:1])])[0]
        mirror = DeviceMaskTable("cpu", zero_copy=False)  # the accelerator's upload path
        mirror.resolve(list(first.rows))
        assert mirror.full_uploads == 1
        uploaded = mirror.rows_uploaded
        # b shares a's client id and asks for a row a has not seen: the server now believes a
        # holds it, so a's reply for that state names a row a lacks -> MissingRow -> resync
        # with the next generation.
        b.client_id = a.client_id
        b.draft_masks([DraftMaskItem(sb, drafts, last_row_only=True)])
        generation = a.dict_generation
        later = a.draft_masks([DraftMaskItem(sa, drafts, last_row_only=True)])[0]
        assert a.dict_generation == generation + 1, "no resync happened"
        assert later.rows.view.epoch == first.rows.view.epoch  # the table was not cleared
        rows = [*first.rows, *later.rows]
        table, ids = mirror.resolve(rows)
        assert mirror.full_uploads == 1
        assert mirror.rows_uploaded - uploaded == later.rows.view.num_rows - first.rows.view.num_rows
        ones = torch.full((first.rows.view.num_mask_words,), -1, dtype=torch.int32)
        assert torch.equal(table[ids.long()], _dense(rows, ones))
        # A clear is a new epoch: everything is uploaded again.
        next(iter(a._tables.values())).clear()
        again = a.draft_masks([DraftMaskItem(sa, drafts[:2])])[0]
        assert again.rows.view.epoch == later.rows.view.epoch + 1
        table, ids = mirror.resolve(list(again.rows))
        assert mirror.full_uploads == 2
        assert torch.equal(table[ids.long()], _dense(list(again.rows), ones))


def test_blocks_resolve_and_mask_like_rows_across_a_clear():
    """A step's rows as blocks (one ``MaskRows`` per request, n all-ones rows for a sequence
    without a grammar) give the same table rows and masked logits as the same rows one by one,
    also with rows of a cleared epoch (gathered once each) and repeats across blocks."""
    from specmask.mask_service.client.row_table import MaskRows, as_blocks

    g = torch.Generator().manual_seed(11)
    dense = random_bitmask(8, V, g, density=0.02)
    dense[7] = ~dense[6]  # a dense row (most tokens allowed)
    source = RowTable(W, capacity=6)
    old = table_rows(dense[0:4], source)  # epoch 1
    mirror = DeviceMaskTable("cpu", zero_copy=False)
    mirror.resolve(old)
    source.clear()
    new = table_rows(dense[4:8], source)  # epoch 2
    rows = [*new[0:2], old[1], None, None, *new[1:4], old[1], old[2], new[3]]
    blocks = as_blocks(rows)
    assert [len(b) if isinstance(b, MaskRows) else b for b in blocks] == [2, 1, 2, 3, 2, 1]
    want_table, want_ids = DeviceMaskTable("cpu", zero_copy=False).resolve(rows)
    got_table, got_ids = mirror.resolve_blocks(blocks)
    assert torch.equal(got_table[got_ids.long()], want_table[want_ids.long()])
    expected = _dense(rows, torch.full((W,), -1, dtype=torch.int32))
    assert torch.equal(got_table[got_ids.long()], expected)
    assert mirror.stale_rows == 2  # old[1] and old[2], once each although old[1] is named twice

    logits = torch.randn(len(rows), V, generator=g)
    by_kernel, by_ids = logits.clone(), logits.clone()
    apply_token_bitmask_indirect_inplace(by_kernel, got_table, got_ids, backend=Backend.REFERENCE)
    mirror.row_index.mask_blocks_(by_ids, blocks)
    assert torch.equal(by_ids, by_kernel)
    # Joining rows of two epochs is refused (the caller keeps them row by row).
    assert MaskRows.join([new[0], old[1]]) is None
    joined = MaskRows.join(new[0:2], MaskRows(new[3].view, np.array([new[3].slot], dtype=np.int32)))
    assert joined is not None and joined.slots.tolist() == [new[0].slot, new[1].slot, new[3].slot]
