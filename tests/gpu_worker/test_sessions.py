"""How a worker settles its sequences' mask-session opens (gpu_worker.sessions), without a
mask service: the opens are real futures completed as the service's answers would be.
The worker-level behaviour over a real service is tests/gpu_worker/test_bad_requests.py."""

from __future__ import annotations

import time
from concurrent.futures import Future

import grpc

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.mask_errors import MASK_TIER_UNAVAILABLE
from specmask.gpu_worker.masks import OpenedSession
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.sessions import MaskSessions, note_session_waits
from specmask.gpu_worker.types import ErrorKind, FinishReason, NewSequence, SessionWait, StepOutput
from specmask.mask_service.client.mask_client import MaskServiceError

GRAMMAR = GrammarSpec(GrammarKind.REGEX, "(yes|no)")


def _opening(seq_id: str, grammar: GrammarSpec | None = GRAMMAR) -> tuple[SequenceState, Future[OpenedSession]]:
    state = SequenceState(NewSequence(seq_id, (5, 6), grammar), frozenset({2}), (), 0, 1, [5, 6])
    opening: Future[OpenedSession] = Future()
    if grammar is not None:
        state.session_opening = opening
        state.opening_since = time.monotonic()
    return state, opening


def test_an_answered_open_gives_the_session_and_its_stop_tokens() -> None:
    sessions = MaskSessions(None, open_timeout_s=60.0, wait_s=1.0)
    state, opening = _opening("a")
    assert sessions.settle(state) is None and state.session_opening is opening  # still opening: wait
    opening.set_result(OpenedSession("sid-a", frozenset({0, 7})))
    assert sessions.settle(state) is None
    assert state.session_id == "sid-a" and state.session_opening is None
    assert state.stop_token_ids == frozenset({0, 2, 7})  # the grammar's ends join the request's stop set
    assert sessions.settle(state) is None  # settling again changes nothing
    plain, _ = _opening("plain", grammar=None)
    assert sessions.settle(plain) is None and plain.session_id is None


def test_a_refused_open_is_worded_for_the_client() -> None:
    sessions = MaskSessions(None, open_timeout_s=60.0, wait_s=1.0)
    refused, opening = _opening("refused")
    opening.set_exception(MaskServiceError(grpc.StatusCode.INVALID_ARGUMENT, "bad regex at 3"))
    failure = sessions.settle(refused)
    assert failure is not None and failure.message == "grammar refused by the mask service: bad regex at 3"
    assert failure.kind is ErrorKind.INTERNAL  # the grammar was validated before admission
    unreachable, down = _opening("down")
    down.set_exception(MaskServiceError(grpc.StatusCode.UNAVAILABLE, "ipv4:127.0.0.1:1: Failed to connect"))
    failure = sessions.settle(unreachable)
    assert failure is not None and failure.kind is ErrorKind.MASK_TIER_UNAVAILABLE
    assert failure.message.startswith(MASK_TIER_UNAVAILABLE)
    assert "127.0.0.1" not in failure.message  # a replica's address means nothing to a client
    out = failure.output("down")  # the kind rides beside the words onto the step output
    assert (out.finish_reason, out.error, out.error_kind) == (FinishReason.ERROR, failure.message, failure.kind)


def test_an_open_past_its_timeout_fails_and_wait_any_returns_on_the_first_answer() -> None:
    sessions = MaskSessions(None, open_timeout_s=5.0, wait_s=30.0)
    slow, _ = _opening("slow")
    slow.opening_since = time.monotonic() - 6.0
    failure = sessions.settle(slow)
    assert failure is not None and failure.kind is ErrorKind.MASK_TIER_UNAVAILABLE
    assert failure.message.startswith(MASK_TIER_UNAVAILABLE) and "took over 6 s" in failure.message
    waiting, never = _opening("waiting")
    ready, answered = _opening("ready")
    answered.set_result(OpenedSession("sid", frozenset()))
    t0 = time.monotonic()
    sessions.wait_any([waiting, ready])  # one has answered: no wait for the other's wait_s
    assert time.monotonic() - t0 < 10.0 and not never.done()


def test_session_waits_are_reported_once_on_the_first_output() -> None:
    active = {s.seq_id: s for s in (_opening(n)[0] for n in ("stepped", "joined", "sat", "plain"))}
    active["plain"] = _opening("plain", grammar=None)[0]
    outputs = [StepOutput("stepped", [1]), StepOutput("plain", [1])]
    note_session_waits(active, {"stepped", "plain"}, [], outputs)  # "joined" and "sat" sat this one out
    assert outputs[0].session_wait is SessionWait.READY and outputs[0].steps_sat_out == 0
    assert outputs[1].session_wait is None  # no grammar: nothing waited for
    second = [StepOutput("stepped", [1]), StepOutput("joined", [1])]
    note_session_waits(active, {"stepped"}, [active["joined"]], second)
    assert second[0].session_wait is None  # reported once
    assert second[1].session_wait is SessionWait.JOINED_LATE and second[1].steps_sat_out == 1
    third = [StepOutput("sat", [1])]
    note_session_waits(active, {"stepped", "sat"}, [], third)
    assert third[0].session_wait is SessionWait.SAT_OUT and third[0].steps_sat_out == 2
