"""What a step's output means for its request (orchestrator.step_outcome): the cases, and the
invariants over every combination of worker finish, stop match and grammar."""

from __future__ import annotations

import itertools

import pytest

from specmask.gpu_worker.types import FinishReason
from specmask.orchestrator.step_outcome import Settle, StepOutcome, step_outcome

F = FinishReason
ALL = itertools.product([None, *FinishReason], [False, True], [False, True])


@pytest.mark.parametrize(
    ("worker", "hit_stop", "grammar", "expected"),
    [
        (None, False, False, StepOutcome(Settle.RUNNING)),
        (None, False, True, StepOutcome(Settle.RUNNING)),
        (None, True, False, StepOutcome(Settle.FINISH, F.STOP, remove=True)),
        (None, True, True, StepOutcome(Settle.CHECK, F.STOP, remove=True)),
        (F.GRAMMAR_COMPLETE, False, True, StepOutcome(Settle.CHECK, F.GRAMMAR_COMPLETE)),
        # The stop match came first: the text up to it is what is checked, with STOP.
        (F.GRAMMAR_COMPLETE, True, True, StepOutcome(Settle.CHECK, F.STOP)),
        (F.LENGTH, True, False, StepOutcome(Settle.FINISH, F.STOP)),
        (F.LENGTH, True, True, StepOutcome(Settle.CHECK, F.STOP)),
        (F.LENGTH, False, True, StepOutcome(Settle.FINISH, F.LENGTH)),
        (F.STOP, False, False, StepOutcome(Settle.FINISH, F.STOP)),
        (F.ERROR, False, True, StepOutcome(Settle.FINISH, F.ERROR)),
        (F.GRAMMAR_VIOLATION, False, True, StepOutcome(Settle.FINISH, F.GRAMMAR_VIOLATION)),
    ],
)
def test_cases(worker: FinishReason | None, hit_stop: bool, grammar: bool, expected: StepOutcome) -> None:
    assert step_outcome(worker, hit_stop=hit_stop, has_grammar=grammar) == expected


@pytest.mark.parametrize(("worker", "hit_stop", "grammar"), list(ALL))
def test_invariants(worker: FinishReason | None, hit_stop: bool, grammar: bool) -> None:
    got = step_outcome(worker, hit_stop=hit_stop, has_grammar=grammar)
    # Running exactly while neither side ended it.
    assert (got.settle is Settle.RUNNING) == (worker is None and not hit_stop)
    assert (got.reason is None) == (got.settle is Settle.RUNNING)
    # Freed with remove() exactly when it ended here and the worker still holds it.
    assert got.remove == (worker is None and got.settle is not Settle.RUNNING)
    # Never lie: a grammar request's successful end is reported only through the end check (the
    # worker itself reports GRAMMAR_COMPLETE for a grammar sequence, never STOP: FinishReason).
    if grammar and (got.reason is F.GRAMMAR_COMPLETE or hit_stop):
        assert got.settle is Settle.CHECK
    # A failure the worker reports is never turned into a success.
    if worker in (F.ERROR, F.GRAMMAR_VIOLATION) and not (hit_stop and grammar):
        assert got == StepOutcome(Settle.FINISH, worker)
