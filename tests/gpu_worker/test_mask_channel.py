"""The worker's mask channel (gpu_worker.masks): DraftMasks calls on their own thread, never
queued behind session opens or closes, and a close never overtaking a call that names its
session. Real mask service over loopback gRPC, real MaskRouter; the router is
wrapped only to record which thread ran each call and to hold a call at a gate (a slow
answer from a busy service)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import ErrorKind
from specmask.mask_service.client.mask_client import DraftMaskItem

SCHEMA = GrammarSpec(
    GrammarKind.JSON_SCHEMA,
    '{"type":"object","properties":{"aa":{"type":"integer"}},"required":["aa"],"additionalProperties":false}',
)
OTHER = GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type":"array","items":{"type":"boolean"}}')
GATE_S = 30.0  # the longest a gated call is held (the test opens the gate long before)


class RecordingRouter:
    """A real MaskRouter that records (call, thread name, start, end) of each call; a call
    whose gate is cleared waits at it (the service is slow to answer) before it runs."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.calls: list[tuple[str, str, float, float]] = []
        self.gates = {name: threading.Event() for name in ("open_session", "draft_masks", "close_session")}
        for gate in self.gates.values():
            gate.set()

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        assert self.gates[name].wait(GATE_S)
        try:
            return getattr(self.router, name)(*args, **kwargs)
        finally:
            self.calls.append((name, threading.current_thread().name, start, time.monotonic()))

    def open_session(self, *args: Any, **kwargs: Any) -> str:
        return self._run("open_session", *args, **kwargs)

    def open_session_info(self, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        assert self.gates["open_session"].wait(GATE_S)
        try:
            return self.router.open_session_info(*args, **kwargs)
        finally:
            self.calls.append(("open_session", threading.current_thread().name, start, time.monotonic()))

    def draft_masks(self, items: Any) -> Any:
        return self._run("draft_masks", items)

    def draft_mask_items(self, items: Any) -> Any:
        # The channel's per-item form of DraftMasks: gated and recorded as "draft_masks".
        start = time.monotonic()
        assert self.gates["draft_masks"].wait(GATE_S)
        try:
            return self.router.draft_mask_items(items)
        finally:
            self.calls.append(("draft_masks", threading.current_thread().name, start, time.monotonic()))

    def close_session(self, session_id: str) -> None:
        self._run("close_session", session_id)

    def close(self) -> None:
        self.router.close()

    def of(self, name: str) -> list[tuple[str, str, float, float]]:
        return [c for c in self.calls if c[0] == name]


@pytest.fixture()
def channel(tiny_pair, mask_address):
    from transformers import AutoConfig

    from specmask.common.tokenizer_id import tokenizer_id_for_path
    from specmask.gpu_worker.masks import MaskChannel
    from specmask.mask_service.client.router import MaskRouter

    vocab_size = AutoConfig.from_pretrained(str(tiny_pair[0])).vocab_size
    router = RecordingRouter(MaskRouter([mask_address], deadline_s=20.0))
    chan = MaskChannel(router, tokenizer_id=tokenizer_id_for_path(tiny_pair[0]), vocab_size=vocab_size)
    yield chan, router
    for gate in router.gates.values():
        gate.set()
    chan.close()


def test_draft_masks_do_not_queue_behind_a_slow_session_open(channel, mask_service):
    """A step's DraftMasks call is answered while another sequence's open is still waiting on
    the service; with one thread for both, it waited for the open (15 ms p99 per call under
    the soak's flood, seconds behind an open waiting on a compile)."""
    chan, router = channel
    running = chan.open_session_async(SCHEMA).result(timeout=20).session_id
    router.gates["open_session"].clear()
    opening = chan.open_session_async(OTHER)
    pending = chan.draft_masks_async([DraftMaskItem(running, [])])
    results, _ = pending.result(timeout=10)  # old channel: TimeoutError, behind the held open
    assert len(results) == 1 and results[0].num_grammar_accepted == 0
    assert not opening.done(), "the open should still be held at its gate"
    router.gates["open_session"].set()
    assert opening.result(timeout=20).session_id != running
    ((_, data_thread, _, _),) = router.of("draft_masks")
    assert data_thread.startswith("mask-io")
    assert all(thread.startswith("mask-control") for _, thread, _, _ in router.of("open_session"))
    for sid in (running, opening.result().session_id):
        chan.close_session_later(sid, "seq")


def test_a_close_waits_for_the_draft_masks_sent_before_it(channel, mask_service):
    """The next step's prefetch may still name a session when its sequence is freed: the close
    runs only after that call has finished (a close first would make the call fail NOT_FOUND
    and the router reopen the session, a leak), and on a control thread, not the data thread.
    No session is left open on the service."""
    chan, router = channel
    rid = f"close-after-draft-{uuid.uuid4().hex[:8]}"
    sid = chan.open_session_async(SCHEMA, request_id=rid).result(timeout=20).session_id
    router.gates["draft_masks"].clear()
    pending = chan.draft_masks_async([DraftMaskItem(sid, [])])
    chan.close_session_later(sid, "seq")
    time.sleep(0.2)  # a close that does not wait for the call would have run by now
    assert router.of("close_session") == []
    router.gates["draft_masks"].set()
    results, _ = pending.result(timeout=20)
    assert results[0].num_grammar_accepted == 0
    deadline = time.monotonic() + 20
    while not router.of("close_session") and time.monotonic() < deadline:
        time.sleep(0.01)
    ((_, close_thread, close_start, _),) = router.of("close_session")
    ((_, _, _, draft_end),) = router.of("draft_masks")
    assert close_start >= draft_end
    assert close_thread.startswith("mask-control")
    assert len(router.of("open_session")) == 1, "the session was reopened"
    assert router.router.session_count() == 0
    assert mask_service.sessions.count_for([rid]) == 0


def test_a_failed_item_fails_its_sequence_alone_in_one_call(channel, mask_service):
    """A batch with an item the service refuses and one naming a session nobody opened: those
    two get their errors, the other its rows, all from one DraftMasks call (the channel used to
    resend the batch without each failed item, a round trip per failure)."""
    chan, router = channel
    good = chan.open_session_async(SCHEMA).result(timeout=20).session_id
    refused = chan.open_session_async(OTHER).result(timeout=20).session_id
    items = [DraftMaskItem(good, []), DraftMaskItem(refused, [10**6]), DraftMaskItem("never-opened", [])]
    pending = chan.request(items, timeout_s=20)
    reply = pending.wait()
    assert set(reply.results) == {good} and reply.results[good].num_grammar_accepted == 0
    assert set(reply.errors) == {refused, "never-opened"}
    assert reply.errors[refused].message.startswith("grammar refused by the mask service")
    assert "NOT_FOUND" in reply.errors["never-opened"].message
    # The service answered both: neither is the tier being away, whatever the words say.
    assert {f.kind for f in reply.errors.values()} == {ErrorKind.INTERNAL}
    assert len(router.of("draft_masks")) == 1
    assert pending.wait() is reply
    for sid in (good, refused):
        chan.close_session_later(sid, "seq")
