"""A seeded sampled request replays exactly, whatever the speculation gate has learned.

The gate chooses between drafting and plain decoding by wall clock (speculation_gate.py), and
a row's randomness follows its steps: without care, the same seeded request would give another
output on a busier machine. A batch holding a seeded sampled row therefore drafts as planned.
"""

from __future__ import annotations

from specmask.gpu_worker.speculation_gate import Arm, BatchKind
from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import run_to_completion


def _teach_plain(gate, kind: BatchKind) -> None:
    """Real steps' figures for ``kind``: drafting costs twice a plain step and gains nothing."""
    for _ in range(200):
        arm = gate.choose(kind)
        seconds = 2.0 if arm is Arm.SPECULATE else 1.0
        gate.record(kind, arm, seconds=seconds, rows=1, tokens=1)
    assert gate.choose(kind) is Arm.PLAIN


def _run(worker, sampling: SamplingParams) -> list[int]:
    seq = NewSequence("s", (5, 6, 7), None, sampling, SpeculationParams(k=3, proposers=("draft_model",)))
    assert worker.add([seq]) == [None]
    return run_to_completion(worker)["s"].tokens


def test_seeded_sampling_replays_when_the_gate_has_learned_plain_decoding(make_worker) -> None:
    sampling = SamplingParams(temperature=1.0, seed=1234, max_tokens=24)
    fresh = make_worker()
    taught = make_worker()
    _teach_plain(taught.stepper.gate, BatchKind.of(1, constrained=False, draft_masks=False, sampled=True))
    expected = _run(fresh, sampling)
    assert len(expected) == 24
    assert _run(taught, sampling) == expected


def test_unseeded_batches_still_follow_the_gate(make_worker) -> None:
    worker = make_worker()
    kind = BatchKind.of(1, constrained=False, draft_masks=False)
    _teach_plain(worker.stepper.gate, kind)
    seq = NewSequence("g", (5, 6, 7), None, SamplingParams(max_tokens=12), SpeculationParams(k=3))
    assert worker.add([seq]) == [None]
    result = run_to_completion(worker)["g"]
    assert len(result.tokens) == 12
    assert result.drafts_proposed <= 3  # at most a probe's drafts: the gate decoded plainly


def test_greedy_and_sampled_batches_are_measured_apart(make_worker) -> None:
    """Sampled traffic that made speculation lose leaves greedy requests drafting."""
    worker = make_worker()
    _teach_plain(worker.stepper.gate, BatchKind.of(1, constrained=False, draft_masks=False, sampled=True))
    seq = NewSequence("g", (5, 6, 7), None, SamplingParams(max_tokens=12), SpeculationParams(k=3))
    assert worker.add([seq]) == [None]
    result = run_to_completion(worker)["g"]
    assert len(result.tokens) == 12
    assert result.drafts_proposed > 3  # drafted beyond a probe: the sampled kind's choice did not apply
    sampled = NewSequence("s", (5, 6, 7), None, SamplingParams(temperature=1.0, max_tokens=12), SpeculationParams(k=3))
    assert worker.add([sampled]) == [None]
    result = run_to_completion(worker)["s"]
    assert len(result.tokens) == 12
    assert result.drafts_proposed <= 3  # an unseeded sampled batch follows what its kind taught
