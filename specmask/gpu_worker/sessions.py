"""The mask sessions of a worker's grammar sequences: opened without waiting, settled at step time, closed when freed.

``add()`` sends a sequence's open on the mask channel's control threads and returns at once
(``MaskSessions.open``). It does not wait: a session is first needed by the sequence's first
step, and add and step share the actor's thread, so waiting there stalled every running
sequence for a round trip while a flood of new grammars kept the mask service busy. The
orchestrator sends add() as soon as it places a request, so the open runs while it handles
the current step's outputs. A step takes the answer once it is in (``settle``: the session id,
and the stop tokens its grammar ends on) or learns why the sequence must fail (refused, or
still opening past the open timeout). A freed sequence's session is closed, or, still
opening, closed once its open answers (``release``): none is left open on the service.
``note_session_waits`` records how each sequence's wait for its session met its first steps.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait

from specmask.gpu_worker.mask_errors import MaskFailure, describe_mask_failure
from specmask.gpu_worker.masks import MaskChannel, OpenedSession
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.types import SessionWait, StepOutput

logger = logging.getLogger(__name__)


class MaskSessions:
    """Session opens and closes for one worker's sequences (see the module docstring).

    ``open_timeout_s``: how long a sequence may stay opening before it fails. An open waits
    for its grammar's compile (the replica answers when it is ready), so this is the compile
    wait, not a mask call's deadline: a slow compile on a busy box is waited for, not refused.
    ``wait_s``: the longest a step blocks for some open to answer when nothing else can run.
    """

    def __init__(self, masks: MaskChannel | None, *, open_timeout_s: float, wait_s: float) -> None:
        self.masks = masks  # None: no mask service; no sequence has a grammar
        self.open_timeout_s = open_timeout_s
        self.wait_s = wait_s

    def open(self, state: SequenceState) -> None:
        """Send ``state``'s open if it has a grammar; it sits steps out until ``settle`` takes it."""
        grammar = state.request.grammar
        if grammar is None:
            return
        assert self.masks is not None, "admission refuses a grammar without a mask service"
        state.session_opening = self.masks.open_session_async(grammar, request_id=state.request_id)
        state.opening_since = time.monotonic()

    def settle(self, state: SequenceState) -> MaskFailure | None:
        """If ``state``'s session open has answered, take its session id, or return why it
        failed. Still opening past ``open_timeout_s`` is a failure too (the router's own
        deadlines end a call well before). None: open, or still opening."""
        opening = state.session_opening
        if opening is None:
            return None
        if not opening.done():
            waited = time.monotonic() - state.opening_since
            if waited <= self.open_timeout_s:
                return None
            return MaskFailure.tier_unavailable(f"opening the grammar session took over {waited:.0f} s")
        state.session_opening = None
        try:
            opened = opening.result()
            state.session_id = opened.session_id
            # The grammar is over once any of its stop tokens is taken, and the service walks
            # no state past it (no row there is real): the sequence stops on each of them.
            state.stop_token_ids = state.stop_token_ids | opened.stop_token_ids
        except Exception as exc:
            logger.warning(
                "[request_id=%s] seq %s: opening mask session failed: %s", state.request_id, state.seq_id, exc
            )
            return describe_mask_failure(exc, "opening the grammar session")
        return None

    def wait_any(self, states: Iterable[SequenceState]) -> None:
        """Block until one of ``states``' opens answers, at most ``wait_s``."""
        opening = [s.session_opening for s in states if s.session_opening is not None]
        if opening:
            futures_wait(opening, timeout=self.wait_s, return_when=FIRST_COMPLETED)

    def wait_all(self, states: Iterable[SequenceState]) -> None:
        """Block until every one of ``states``' opens answers, at most ``open_timeout_s``."""
        opening = [s.session_opening for s in states if s.session_opening is not None]
        if opening:
            futures_wait(opening, timeout=self.open_timeout_s)

    def release(self, state: SequenceState) -> None:
        """Close the session of a freed sequence, once every mask call sent before has
        finished (masks.MaskChannel.close_session_later); an open still in flight is closed
        when it answers."""
        if state.session_opening is not None:
            # Freed before its session opened: close it once it does, so none is left open.
            opening, state.session_opening = state.session_opening, None
            opening.add_done_callback(functools.partial(self._close_late, state.seq_id, state.request_id))
        if state.session_id is not None and self.masks is not None:
            self.masks.close_session_later(state.session_id, state.seq_id, request_id=state.request_id)
            state.session_id = None

    def _close_late(self, seq_id: str, request_id: str, opening: Future[OpenedSession]) -> None:
        if self.masks is None or opening.cancelled() or opening.exception() is not None:
            return
        try:
            self.masks.close_session_later(opening.result().session_id, seq_id, request_id=request_id)
        except RuntimeError as exc:  # the channel is closed (shutdown): the service's TTL reclaims it
            logger.warning("[request_id=%s] seq %s: mask session left to expire: %s", request_id, seq_id, exc)


def note_session_waits(
    active: Mapping[str, SequenceState],
    in_batch: Collection[str],
    joined: Sequence[SequenceState],
    outputs: Sequence[StepOutput],
) -> None:
    """Count a step against the ``active`` sequences it did not take (still opening, or
    opened after the join point), and put how each grammar sequence's wait ended on its
    first output (``SessionWait``). ``in_batch``: the step's batch; ``joined``: its late joiners."""
    joined_ids = {s.seq_id for s in joined}
    for waiting in active.values():
        if waiting.seq_id in joined_ids:
            waiting.joined_late = True
        elif waiting.seq_id not in in_batch:
            waiting.steps_sat_out += 1
    for out in outputs:
        state = active.get(out.seq_id)
        if state is None or not state.has_grammar or state.session_wait_reported:
            continue
        state.session_wait_reported = True
        out.steps_sat_out = state.steps_sat_out
        if state.joined_late:
            out.session_wait = SessionWait.JOINED_LATE
        else:
            out.session_wait = SessionWait.SAT_OUT if state.steps_sat_out else SessionWait.READY
