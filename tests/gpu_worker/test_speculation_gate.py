"""The speculation gate: plain decoding where drafts do not pay, speculation back when they do."""

from __future__ import annotations

import itertools

from specmask.gpu_worker.speculation_gate import (
    MAX_PROBE_EVERY,
    MIN_PROBE_EVERY,
    WARMUP_STEPS,
    Arm,
    BatchKind,
    SpeculationGate,
)

KIND = BatchKind.of(4, constrained=True, draft_masks=False)


def _run(
    gate: SpeculationGate, steps: int, *, spec_tokens: float, spec_s: float = 2.0, plain_s: float = 1.0
) -> list[Arm]:
    """``steps`` steps of a 4-row batch whose speculative step costs ``spec_s`` and emits
    ``spec_tokens`` per row, and whose plain step costs ``plain_s`` for one token per row."""
    arms = []
    for _ in range(steps):
        arm = gate.choose(KIND)
        arms.append(arm)
        if arm is Arm.SPECULATE:
            gate.record(KIND, arm, seconds=spec_s, rows=4, tokens=round(4 * spec_tokens))
        else:
            gate.record(KIND, arm, seconds=plain_s, rows=4, tokens=4)
    return arms


def test_batch_kinds_bucket_the_size() -> None:
    assert BatchKind.of(1, constrained=False, draft_masks=False).size_bucket == 1
    assert BatchKind.of(3, constrained=False, draft_masks=False).size_bucket == 4
    assert BatchKind.of(64, constrained=False, draft_masks=False).size_bucket == 64
    assert BatchKind.of(65, constrained=False, draft_masks=False).size_bucket == 128


def test_drafts_that_do_not_pay_are_switched_off_and_probed_ever_more_rarely() -> None:
    gate = SpeculationGate()
    arms = _run(gate, 2000, spec_tokens=1.0)  # nothing accepted, twice the cost
    assert arms[:WARMUP_STEPS] == [Arm.SPECULATE] * WARMUP_STEPS
    assert arms[WARMUP_STEPS] is Arm.PLAIN  # the first measurement of the plain step: it wins
    probes = [i for i, a in enumerate(arms) if a is Arm.SPECULATE and i > WARMUP_STEPS]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == sorted(gaps) and gaps[-1] == MAX_PROBE_EVERY + 1
    assert gaps[0] == 2 * MIN_PROBE_EVERY + 1  # the first probe confirmed: doubled
    # Throughput against plain decoding throughout: each step that drafted cost one extra unit.
    spec_steps = arms.count(Arm.SPECULATE)
    ratio = len(arms) / (len(arms) + spec_steps)
    assert ratio >= 0.95, ratio


def test_drafts_that_pay_keep_speculating_and_probe_ever_more_rarely() -> None:
    gate = SpeculationGate()
    arms = _run(gate, 1000, spec_tokens=3.0)  # 3 tokens per row for twice the cost: 1.5x
    assert arms[WARMUP_STEPS] is Arm.PLAIN  # the plain step's first measurement
    plain = [i for i, a in enumerate(arms) if a is Arm.PLAIN]
    gaps = [b - a for a, b in itertools.pairwise(plain)]
    assert gaps == sorted(gaps) and gaps[-1] == MAX_PROBE_EVERY + 1
    assert len(plain) <= 1000 // MAX_PROBE_EVERY + 4


def test_a_probe_measures_the_other_arm_afresh_and_an_outlier_step_is_dropped() -> None:
    """A slow first plain step (a first-time cost) does not keep speculation on: the slowest
    step of a window is left out, and each probe replaces the probed arm's old figures."""
    gate = SpeculationGate()
    gate.record(KIND, Arm.PLAIN, seconds=50.0, rows=4, tokens=4)  # a step the batch could not draft in
    arms = _run(gate, 100, spec_tokens=1.0)
    assert gate.kinds[KIND].current is Arm.PLAIN
    # The first probe comes at the probe interval (the slow step made speculation look better
    # until then), and replaces that step: plain from then on, but for the later probes.
    assert arms.count(Arm.SPECULATE) <= MIN_PROBE_EVERY + 100 // MIN_PROBE_EVERY
    assert arms[-40:].count(Arm.SPECULATE) <= 40 // MIN_PROBE_EVERY


def test_speculation_comes_back_when_acceptance_improves() -> None:
    gate = SpeculationGate()
    _run(gate, 1000, spec_tokens=1.0)
    assert gate.kinds[KIND].current is Arm.PLAIN
    arms = _run(gate, MAX_PROBE_EVERY + 2 + 100, spec_tokens=4.0)
    assert gate.kinds[KIND].current is Arm.SPECULATE
    assert arms[-50:].count(Arm.PLAIN) <= 50 // MIN_PROBE_EVERY  # the plain step's probes only


def test_acceptance_falling_switches_speculation_off() -> None:
    gate = SpeculationGate()
    _run(gate, 300, spec_tokens=4.0)
    assert gate.kinds[KIND].current is Arm.SPECULATE
    arms = _run(gate, 100, spec_tokens=1.0)
    assert gate.kinds[KIND].current is Arm.PLAIN
    assert arms[-50:].count(Arm.SPECULATE) <= 50 // MIN_PROBE_EVERY


def test_kinds_are_learned_apart_and_a_disabled_gate_always_speculates() -> None:
    gate = SpeculationGate()
    _run(gate, 300, spec_tokens=1.0)
    other = BatchKind.of(64, constrained=True, draft_masks=False)
    assert gate.choose(KIND) is Arm.PLAIN and gate.choose(other) is Arm.SPECULATE
    off = SpeculationGate(enabled=False)
    _run(off, 300, spec_tokens=1.0)
    assert off.choose(KIND) is Arm.SPECULATE


MASKED_KIND = BatchKind.of(4, constrained=True, draft_masks=True, unmaskable=True)


def _run3(gate: SpeculationGate, steps: int, *, costs: dict[Arm, tuple[float, float]]) -> list[Arm]:
    """``steps`` steps of a 4-row batch that may also draft without draft-side masks; ``costs``
    gives each arm's (seconds per step, tokens per row per step)."""
    arms = []
    for _ in range(steps):
        arm = gate.choose(MASKED_KIND)
        arms.append(arm)
        seconds, tokens = costs[arm]
        gate.record(MASKED_KIND, arm, seconds=seconds, rows=4, tokens=round(4 * tokens))
    return arms


def test_only_batches_that_can_draft_unmasked_get_that_arm() -> None:
    assert MASKED_KIND.arms == (Arm.SPECULATE, Arm.SPECULATE_UNMASKED, Arm.PLAIN)
    assert KIND.arms == (Arm.SPECULATE, Arm.PLAIN)
    # Without draft masks there is nothing to turn off.
    assert not BatchKind.of(4, constrained=True, draft_masks=False, unmaskable=True).unmaskable
    assert [a for a in Arm if a.drafts] == [Arm.SPECULATE, Arm.SPECULATE_UNMASKED]


def test_draft_masks_that_cost_more_than_they_buy_are_switched_off() -> None:
    """Masked drafts: 3.2 tokens per row for 2.0 s (1.6/s); unmasked: 3.0 for 1.5 s (2.0/s);
    plain: 1.0 for 1.0 s. The gate settles on unmasked drafts and probes the others rarely."""
    gate = SpeculationGate()
    costs = {Arm.SPECULATE: (2.0, 3.2), Arm.SPECULATE_UNMASKED: (1.5, 3.0), Arm.PLAIN: (1.0, 1.0)}
    arms = _run3(gate, 1000, costs=costs)
    assert arms[:WARMUP_STEPS] == [Arm.SPECULATE] * WARMUP_STEPS
    assert set(arms[WARMUP_STEPS : WARMUP_STEPS + 2]) == {Arm.PLAIN, Arm.SPECULATE_UNMASKED}  # first figures
    assert gate.kinds[MASKED_KIND].current is Arm.SPECULATE_UNMASKED
    tail = arms[200:]
    assert tail.count(Arm.SPECULATE_UNMASKED) >= len(tail) - 2 * (len(tail) // MAX_PROBE_EVERY + 2)
    # Both other arms are still probed (the figures may change).
    assert Arm.SPECULATE in tail and Arm.PLAIN in tail
    # Throughput within 5% of always running the best arm.
    spent = sum(costs[a][0] for a in arms)
    made = sum(costs[a][1] for a in arms)
    best = costs[Arm.SPECULATE_UNMASKED][1] / costs[Arm.SPECULATE_UNMASKED][0]
    assert made / spent >= 0.95 * best


def test_draft_masks_that_pay_stay_on() -> None:
    """Masked drafts 4.5 tokens for 2.0 s (2.25/s) against unmasked 2.5 for 1.5 s (1.67/s)."""
    gate = SpeculationGate()
    costs = {Arm.SPECULATE: (2.0, 4.5), Arm.SPECULATE_UNMASKED: (1.5, 2.5), Arm.PLAIN: (1.0, 1.0)}
    arms = _run3(gate, 1000, costs=costs)
    assert gate.kinds[MASKED_KIND].current is Arm.SPECULATE
    tail = arms[200:]
    assert tail.count(Arm.SPECULATE) >= len(tail) - 2 * (len(tail) // MAX_PROBE_EVERY + 2)


def test_the_gate_follows_when_draft_masks_start_paying() -> None:
    gate = SpeculationGate()
    cheap = {Arm.SPECULATE: (2.0, 3.2), Arm.SPECULATE_UNMASKED: (1.5, 3.0), Arm.PLAIN: (1.0, 1.0)}
    _run3(gate, 500, costs=cheap)
    assert gate.kinds[MASKED_KIND].current is Arm.SPECULATE_UNMASKED
    paying = {Arm.SPECULATE: (2.0, 5.0), Arm.SPECULATE_UNMASKED: (1.5, 2.0), Arm.PLAIN: (1.0, 1.0)}
    arms = _run3(gate, 2 * MAX_PROBE_EVERY + 100, costs=paying)
    assert gate.kinds[MASKED_KIND].current is Arm.SPECULATE
    assert arms[-50:].count(Arm.SPECULATE) >= 50 - 2 * (50 // MIN_PROBE_EVERY + 1)


def test_no_drafting_arm_pays_then_plain_decoding() -> None:
    gate = SpeculationGate()
    costs = {Arm.SPECULATE: (2.0, 1.2), Arm.SPECULATE_UNMASKED: (1.5, 1.1), Arm.PLAIN: (1.0, 1.0)}
    arms = _run3(gate, 1000, costs=costs)
    assert gate.kinds[MASKED_KIND].current is Arm.PLAIN
    spent = sum(costs[a][0] for a in arms)
    made = sum(costs[a][1] for a in arms)
    assert made / spent >= 0.95


def test_an_arm_the_kind_does_not_offer_is_not_learned() -> None:
    gate = SpeculationGate()
    gate.record(KIND, Arm.SPECULATE, seconds=1.0, rows=1, tokens=2)
    gate.record(KIND, Arm.SPECULATE_UNMASKED, seconds=1.0, rows=1, tokens=2)
    assert Arm.SPECULATE_UNMASKED not in gate.kinds[KIND].arms
