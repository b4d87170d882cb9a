"""The worker's sequence table: every way a sequence leaves frees its KV slot, ids the worker
does not hold are reported, and a failed session open ends its sequence as an error of the
kind the failure says. Real states, KV slot pools and session bookkeeping; no model."""

from __future__ import annotations

import time
from concurrent.futures import Future

import grpc
import pytest
import torch

from specmask.gpu_worker.kv_cache import SequenceKV, SlotPool
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.sequence_table import SequenceTable
from specmask.gpu_worker.sessions import MaskSessions
from specmask.gpu_worker.types import ErrorKind, FinishReason, NewSequence
from specmask.mask_service.client.mask_client import MaskServiceError


@pytest.fixture
def pool() -> SlotPool:
    return SlotPool(2, 1, 4, dtype=torch.float32, device="cpu")


def _state(seq_id: str, pool: SlotPool, *, draft: SlotPool | None = None) -> SequenceState:
    state = SequenceState(
        request=NewSequence(seq_id, (1, 2, 3), None, request_id=f"r-{seq_id}"),
        stop_token_ids=frozenset({0}),
        proposers=(),
        k=0,
        seed=1,
        token_ids=[1, 2, 3],
    )
    pool.bind(state.target_kv)
    if draft is not None:
        state.draft_kv = SequenceKV()
        draft.bind(state.draft_kv)
    return state


def _table() -> SequenceTable:
    return SequenceTable(MaskSessions(None, open_timeout_s=5.0, wait_s=0.01))


def test_arrival_order_is_kept_and_every_way_out_frees_the_slot(pool: SlotPool) -> None:
    draft = SlotPool(1, 1, 4, dtype=torch.float32, device="cpu")
    table = _table()
    for seq_id in ("a", "b", "c", "d"):
        table.hold(_state(seq_id, pool, draft=draft if seq_id == "b" else None))
    assert list(table) == ["a", "b", "c", "d"] and [v.seq_id for v in table.views()] == ["a", "b", "c", "d"]
    assert pool.num_used == 4 and draft.num_used == 1

    finished = table.retire("b", FinishReason.STOP)
    assert finished.finished is FinishReason.STOP and "b" not in table
    assert pool.num_used == 3 and draft.num_used == 0  # both caches of the sequence
    assert table.cancel(["zz", "a", "a"]) == ["zz", "a"]  # the second "a" is gone by then
    assert pool.num_used == 2 and list(table) == ["c", "d"]
    assert table.cancel_all() == 2 and len(table) == 0 and pool.num_used == 0
    assert table.cancel_all() == 0


def test_a_failed_prompt_read_ends_held_and_not_yet_held_sequences(pool: SlotPool) -> None:
    table = _table()
    held, joining = _state("held", pool), _state("joining", pool)
    table.hold(held)
    outputs = table.fail([held, joining], "prefill failed: boom")
    assert [(o.seq_id, o.finish_reason, o.error) for o in outputs] == [
        ("held", FinishReason.ERROR, "prefill failed: boom"),
        ("joining", FinishReason.ERROR, "prefill failed: boom"),
    ]
    assert len(table) == 0 and pool.num_used == 0
    assert held.finished is joining.finished is FinishReason.ERROR


def test_a_session_open_that_failed_ends_its_sequence_and_one_still_opening_waits(pool: SlotPool) -> None:
    table = _table()
    refused, opening, plain = _state("refused", pool), _state("opening", pool), _state("plain", pool)
    refused.session_opening = Future()
    refused.session_opening.set_exception(MaskServiceError(grpc.StatusCode.UNAVAILABLE, "no replica"))
    opening.session_opening = Future()  # not answered yet, well inside the open timeout
    opening.opening_since = time.monotonic()
    for s in (refused, opening, plain):
        table.hold(s)
    outputs = table.settle_sessions(wait=True)  # waits up to wait_s for an answer: one is there
    assert [(o.seq_id, o.finish_reason, o.error_kind) for o in outputs] == [
        ("refused", FinishReason.ERROR, ErrorKind.MASK_TIER_UNAVAILABLE)
    ]
    assert list(table) == ["opening", "plain"] and pool.num_used == 2
    assert refused.finished is FinishReason.ERROR and opening.session_opening is not None
    opening.session_opening.cancel()
    table.cancel_all()
    assert pool.num_used == 0


def test_an_id_is_held_once(pool: SlotPool) -> None:
    """Admission refuses a duplicate id; a table that took one anyway would lose the first
    sequence's slot, so holding it twice is a bug caught here, not a leak."""
    table = _table()
    table.hold(_state("a", pool))
    second = _state("a", pool)
    with pytest.raises(ValueError, match="already holds"):
        table.hold(second)
    assert table["a"] is not second
