"""Draft-side masks only where they pay: a batch the speculation gate has measured drafting
faster without them drafts on the device with no draft-side mask round trip, and its output is
the output of plain constrained decoding (greedy), as with draft masks."""

from __future__ import annotations

import json

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.host_counter import StepCounter
from specmask.gpu_worker.speculation_gate import Arm, BatchKind, SpeculationGate
from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import run_to_completion

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"],
    }
)
KIND = BatchKind.of(1, constrained=True, draft_masks=True, unmaskable=True)


def _teach(gate: SpeculationGate, best: Arm) -> None:
    """Figures for ``KIND`` under which ``best`` makes the most tokens per second."""
    rates = {Arm.SPECULATE: (2.0, 3.0), Arm.SPECULATE_UNMASKED: (2.0, 3.0), Arm.PLAIN: (1.0, 1.0)}
    seconds, tokens = rates[best]
    rates[best] = (seconds / 2, tokens)
    for _ in range(300):
        arm = gate.choose(KIND)
        s, t = rates[arm]
        gate.record(KIND, arm, seconds=s, rows=1, tokens=round(t))
    assert gate.kinds[KIND].current is best


def _seq(seq_id: str, spec: SpeculationParams, max_tokens: int = 40) -> NewSequence:
    return NewSequence(
        seq_id, (5, 6, 7), GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA), SamplingParams(max_tokens=max_tokens), spec
    )


def test_unmasked_drafting_is_exact_and_drafts(make_worker) -> None:
    plain = make_worker()
    assert plain.add([_seq("p", SpeculationParams(enabled=False, k=0))]) == [None]
    expected = run_to_completion(plain)["p"].tokens
    assert expected

    worker = make_worker()
    _teach(worker.stepper.gate, Arm.SPECULATE_UNMASKED)
    assert worker.add([_seq("u", SpeculationParams(k=3, proposers=("draft_model",)))]) == [None]
    result = run_to_completion(worker)["u"]
    assert result.tokens == expected
    assert result.drafts_proposed > 3  # it drafted (beyond a probe's worth)


def test_unmasked_steps_send_no_draft_side_mask_requests(make_worker) -> None:
    """Counted steps: taught to draft unmasked, a step's only mask request is the verify path's
    (the drafts come back once, for it); taught that masks pay, the step asks per position."""
    round_trips = {}
    for best in (Arm.SPECULATE_UNMASKED, Arm.SPECULATE):
        worker = make_worker(step_prefill_tokens=1)
        _teach(worker.stepper.gate, best)
        seq = _seq("c", SpeculationParams(k=3, proposers=("draft_model",)), 200)
        assert worker.add([seq], wait_for_sessions=True) == [None]
        worker.step()
        trips = []
        with StepCounter(worker, "cpu") as counter:
            for _ in range(3):
                assert worker.stepper.gate.choose(KIND) is best
                outs, count = counter.step()
                assert not any(o.error for o in outs) and outs[0].drafts_proposed > 0, outs
                assert count.reads <= 1 + count.round_trips, count.read_sites
                trips.append(count.round_trips)
        round_trips[best] = trips
    assert round_trips[Arm.SPECULATE_UNMASKED] == [1, 1, 1]
    assert all(t > 1 for t in round_trips[Arm.SPECULATE]), round_trips
