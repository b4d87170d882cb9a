"""The sequences one worker holds, and the one way each leaves it.

A sequence joins the table once admitted and its session open has not failed
(``GpuWorker.add``), and leaves it by ``retire``: finished by a step, cancelled, reset,
failed by its prefill or by its session open. Every way out frees its KV caches and
releases its mask session, so no path can drop a sequence and leak either.

The table is a read-only mapping (seq id -> ``SequenceState``) in arrival order, which is
the batch order the planner (gpu_worker.planning) takes sequences in.
"""

from __future__ import annotations

import logging
from collections.abc import ItemsView, Iterator, Mapping, Sequence, ValuesView

from specmask.gpu_worker.planning import PlanSeq
from specmask.gpu_worker.prefill import plan_view
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.sessions import MaskSessions
from specmask.gpu_worker.types import FinishReason, StepOutput

logger = logging.getLogger(__name__)


class SequenceTable(Mapping[str, SequenceState]):
    """Seq id -> state of the sequences a worker holds (insertion order = batch order)."""

    def __init__(self, sessions: MaskSessions) -> None:
        self._sessions = sessions  # releases a leaving sequence's mask session
        self._seqs: dict[str, SequenceState] = {}

    def __getitem__(self, seq_id: str) -> SequenceState:
        return self._seqs[seq_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)

    # The dict's own views (read-only, as the table is): Mapping's would look each id up again,
    # on the step's path.
    def values(self) -> ValuesView[SequenceState]:
        return self._seqs.values()

    def items(self) -> ItemsView[str, SequenceState]:
        return self._seqs.items()

    def hold(self, state: SequenceState) -> None:
        """Take an admitted sequence. Admission refuses an id already held; were one to slip
        through, replacing the held sequence would leak its KV slot and mask session."""
        if state.seq_id in self._seqs:
            raise ValueError(f"the worker already holds sequence {state.seq_id!r}")
        self._seqs[state.seq_id] = state

    def views(self) -> list[PlanSeq]:
        """The sequences as the planner sees them, in arrival order."""
        return [plan_view(s) for s in self._seqs.values()]

    def retire(self, seq_id: str, reason: FinishReason) -> SequenceState:
        """Take a held sequence off the table, finished for ``reason``, and free it."""
        state = self._seqs.pop(seq_id)
        state.finished = reason
        free(state, self._sessions)
        return state

    def cancel(self, seq_ids: Sequence[str]) -> list[str]:
        """Retire the held ones of ``seq_ids`` as CANCELLED; returns the ids not held."""
        unknown = []
        for seq_id in seq_ids:
            if seq_id not in self._seqs:
                unknown.append(seq_id)
                continue
            state = self.retire(seq_id, FinishReason.CANCELLED)
            logger.info(
                "[request_id=%s] seq %s cancelled after %d output tokens", state.request_id, seq_id, state.num_output
            )
        return unknown

    def cancel_all(self) -> int:
        """Retire every sequence as CANCELLED; returns how many there were."""
        return len([self.retire(seq_id, FinishReason.CANCELLED) for seq_id in list(self._seqs)])

    def fail(self, states: Sequence[SequenceState], why: str) -> list[StepOutput]:
        """Retire ``states`` as ERROR (held or not yet: a prompt read before they joined) and
        report each with ``why``."""
        failed = []
        for s in states:
            self._seqs.pop(s.seq_id, None)
            s.finished = FinishReason.ERROR
            free(s, self._sessions)
            failed.append(StepOutput(s.seq_id, [], FinishReason.ERROR, error=why))
        return failed

    def settle_sessions(self, *, wait: bool) -> list[StepOutput]:
        """Settle every opening session (``wait``: first block until one answers, up to the mask
        timeout); a sequence whose open failed is retired and reported as an ERROR output."""
        opening = [s for s in self._seqs.values() if s.session_opening is not None]
        if wait:
            self._sessions.wait_any(opening)
        failed = []
        for state in opening:
            failure = self._sessions.settle(state)
            if failure is not None:
                self.retire(state.seq_id, FinishReason.ERROR)
                failed.append(failure.output(state.seq_id))
        return failed


def free(state: SequenceState, sessions: MaskSessions) -> None:
    """Free a sequence's KV caches and release its mask session (held by a table or not)."""
    state.target_kv.free()
    if state.draft_kv is not None:
        state.draft_kv.free()
    sessions.release(state)
