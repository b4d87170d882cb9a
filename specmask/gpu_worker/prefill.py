"""Reading prompts into the KV caches, chunk by chunk, as gpu_worker.planning plans them.

A chunk runs in a target forward of the worker's own when nothing steps (``PromptReader.read``),
rides in a step's target forward (``ChunkRiders``), or, before any step, comes whole
(``read_whole``: ``add(wait_for_sessions=True)``, for benchmarks and replays). The draft
model's cache of a sequence keeps pace with its target's. A sequence whose chunk cannot be
read is handed to the worker's ``fail`` (freed, reported as an ERROR output) and the others
are read on: one bad prompt never fails its neighbours.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from specmask.gpu_worker.model_runner import ForwardItem, ModelRunner
from specmask.gpu_worker.planning import IterationPlanner, PlanSeq, whole_chunk
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.types import StepOutput

logger = logging.getLogger(__name__)

# Prompt chunks to feed: each sequence with its tokens (those after its target's cache).
Chunks = list[tuple[SequenceState, list[int]]]
# Free the sequences whose prompt could not be read, and report each (``SequenceTable.fail``).
FailPrefill = Callable[[Sequence[SequenceState], str], list[StepOutput]]


def plan_view(s: SequenceState) -> PlanSeq:
    """``s`` as the scheduler sees it (gpu_worker.planning)."""
    return PlanSeq(s.seq_id, s.target_kv.length, len(s.token_ids), s.prefill_to, s.session_opening is None)


class PromptReader:
    """Runs prompt chunks through the target and draft models (see the module docstring)."""

    def __init__(self, target: ModelRunner, draft: ModelRunner | None, fail: FailPrefill) -> None:
        self.target = target
        self.draft = draft
        self._fail = fail
        # Prefill forwards finished: part of the heartbeat's progress (GpuWorker.progress),
        # read from its own thread while an iteration runs.
        self.forwards = 0

    def reserve(self, states: Sequence[SequenceState]) -> None:
        """Room in each pool for new sequences' prompts and first tokens (up to 64, drafts
        included), in one resize, not one per chunk that passes the capacity while the running
        sequences wait on each."""
        if not states:
            return
        longest = max(len(s.token_ids) + min(s.request.sampling.max_tokens, 64) + s.k + 1 for s in states)
        for runner in (self.target, self.draft):
            if runner is None:
                continue
            try:
                runner.reserve(len(states), longest)
            except Exception:  # e.g. out of memory: the forwards grow what they need, or fail alone
                logger.warning("could not grow the %s KV pool for %d sequences", runner.name, len(states))

    def read_whole(self, states: Sequence[SequenceState]) -> None:
        """Cache each prompt up to its tail now, sequence by sequence, a whole chunk at a time
        (planning.whole_chunk). Raises on the first failure (the caller fails them all)."""
        for s in states:
            while s.prefilling:
                c = whole_chunk(plan_view(s))
                self.target.forward([ForwardItem(s.target_kv, s.token_ids[c.start : c.start + c.count], 0)])
                self.forward_drafts([s])
                self.forwards += 1

    def read(self, chunks: Chunks) -> list[StepOutput]:
        """An iteration with nothing to step: ``chunks`` in one target forward. If that forward
        fails, each chunk is retried in a forward of its own, so a sequence whose prefill fails
        is freed and reported as an ERROR output alone."""
        if not chunks:
            return []
        try:
            self.target.forward([ForwardItem(s.target_kv, chunk, 0) for s, chunk in chunks])
        except Exception as exc:
            if len(chunks) == 1:
                return self._failed([chunks[0][0]], f"prefill failed: {exc}")
            logger.warning("a prefill forward of %d chunks failed (%s); retrying them one by one", len(chunks), exc)
            self.forwards += 1
            return self.read_alone(chunks)
        self.forwards += 1
        return self.catch_up_drafts([s for s, _ in chunks])

    def read_alone(self, chunks: Chunks) -> list[StepOutput]:
        """Each chunk in a target forward of its own (after a forward with them all failed): a
        sequence whose chunk fails again is freed and reported; the rest are read."""
        failed: list[StepOutput] = []
        for s, chunk in chunks:
            try:
                self.target.forward([ForwardItem(s.target_kv, chunk, 0)])
            except Exception as one:
                failed += self._failed([s], f"prefill failed: {one}")
        return failed + self.catch_up_drafts([s for s, _ in chunks if s.finished is None])

    def catch_up_drafts(self, states: Sequence[SequenceState]) -> list[StepOutput]:
        """Bring the draft model's caches of ``states`` level with the target's (after their
        prompt chunks); a sequence whose draft forward fails is freed and reported."""
        try:
            self.forward_drafts(states)
        except Exception:
            logger.warning("a draft prefill forward of %d sequences failed; retrying them one by one", len(states))
            failed: list[StepOutput] = []
            for s in states:
                try:
                    self.forward_drafts([s])
                except Exception as exc:
                    failed += self._failed([s], f"draft prefill failed: {exc}")
            return failed
        return []

    def forward_drafts(self, states: Sequence[SequenceState]) -> None:
        """One draft forward feeding each of ``states`` the prompt tokens its target has cached
        and its draft has not: the draft keeps pace with the target's prefill."""
        items = [
            ForwardItem(s.draft_kv, s.token_ids[s.draft_kv.length : s.target_kv.length], 0)
            for s in states
            if s.draft_kv is not None and s.draft_kv.length < s.target_kv.length
        ]
        if items:
            assert self.draft is not None
            self.draft.forward(items)

    def _failed(self, states: Sequence[SequenceState], why: str) -> list[StepOutput]:
        for s in states:
            logger.exception("[request_id=%s] seq %s: %s", s.request_id, s.seq_id, why)
        return self._fail(states, why)


class ChunkRiders:
    """A step's prompt chunks (``GpuWorker._step``): planned with what the step's rows leave of
    the iteration's budget, fed in the step's target forward (step.Riders)."""

    def __init__(self, planner: IterationPlanner, plan: Callable[[float], Chunks]) -> None:
        self.planner = planner
        self._plan = plan  # the chunks to read within a budget (GpuWorker._plan_chunks)
        self.chunks: Chunks = []  # what rode: each sequence's chunk
        self.error: Exception | None = None  # the forward with them failed (the step went on)

    def take(self, used: float) -> list[ForwardItem]:
        self.chunks = self._plan(self.planner.rider_budget(used))
        return [ForwardItem(s.target_kv, chunk, 0) for s, chunk in self.chunks]

    def failed(self, exc: Exception) -> None:
        n = len(self.chunks)
        logger.error(
            "a step's forward with %d prompt chunks failed (%s); the step went on, they are read alone", n, exc
        )
        self.error = exc
