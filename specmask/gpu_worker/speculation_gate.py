"""Whether a step speculates at all: speculation must never cost tokens per second.

Owns ``SpeculationGate``: per kind of batch (``BatchKind``), the measured tokens per row per
second of steps with drafts and without, the probes of the arm not running, and the choice
before proposal between drafting (k_r as planned) and plain decoding (k_r = 0 for every row).
Exactness does not depend on the choice: speculative decoding is exact for any k_r
(docs/design.md). The rules and their constants: docs/performance.md, "Speculation that
never costs: the speculation gate".
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from dataclasses import dataclass, field

# Speculative steps of a batch kind before the plain step is first measured: the first
# steps of a kind carry one-off costs (new graphs, new cache sizes) and too few acceptances.
WARMUP_STEPS = 8
# Steps between probes of the arm not running, at first and at most (doubled by each
# probe that confirms the current arm).
MIN_PROBE_EVERY = 16
MAX_PROBE_EVERY = 64
# Steps an arm's figures are taken over, and the steps of one probe. One probe step is
# enough: a single step misjudges the other arm only where the two are close, and there
# the wrong arm costs little; a longer probe costs its steps every time.
WINDOW = 8
PROBE_STEPS = 1


class Arm(enum.Enum):
    """What a step does with its drafts."""

    SPECULATE = enum.auto()  # k_r as planned, draft-side masks as the requests ask
    # k_r as planned, the draft model alone and no draft-side mask round trips (the device
    # draft loop); the verifier still masks every position. Offered where draft-side masks
    # cost more than the acceptance they buy (BatchKind.unmaskable).
    SPECULATE_UNMASKED = enum.auto()
    PLAIN = enum.auto()  # k_r = 0 for every row

    @property
    def drafts(self) -> bool:
        return self is not Arm.PLAIN


@dataclass(frozen=True)
class BatchKind:
    """The batch properties a step's cost depends on most; the gate measures each apart."""

    size_bucket: int  # the batch size rounded up to a power of two
    constrained: bool  # any row has a grammar
    draft_masks: bool  # any row masks its draft model's logits (a mask round trip per position)
    # Any row samples (temperature > 0). Acceptance of sampled rows is far below greedy rows'
    # on the same models, so one traffic mix must not decide for the other: a stretch of
    # sampled requests that made speculation lose would otherwise switch it off for greedy ones.
    sampled: bool = False
    # With draft masks, every row drafts with the draft model, so the batch can also draft
    # without draft-side masks (Arm.SPECULATE_UNMASKED).
    unmaskable: bool = False

    @classmethod
    def of(
        cls, size: int, *, constrained: bool, draft_masks: bool, sampled: bool = False, unmaskable: bool = False
    ) -> BatchKind:
        return cls(1 << max(0, size - 1).bit_length(), constrained, draft_masks, sampled, draft_masks and unmaskable)

    @property
    def arms(self) -> tuple[Arm, ...]:
        """The arms a batch of this kind may run, in order of preference on equal figures."""
        if self.unmaskable:
            return (Arm.SPECULATE, Arm.SPECULATE_UNMASKED, Arm.PLAIN)
        return (Arm.SPECULATE, Arm.PLAIN)


@dataclass
class _Arm:
    """One arm's recent steps, for one batch kind."""

    seconds: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # per step
    tokens: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # per row, per step
    steps: int = 0  # measured steps, all told
    stale: bool = False  # the next step starts the figures afresh (a probe)

    def add(self, seconds: float, tokens_per_row: float) -> None:
        if self.stale:
            self.seconds.clear()
            self.tokens.clear()
            self.stale = False
        self.seconds.append(seconds)
        self.tokens.append(tokens_per_row)
        self.steps += 1

    @property
    def rate(self) -> float:
        """Tokens per row per second."""
        kept = sorted(self.seconds)[:-1] if len(self.seconds) > 2 else list(self.seconds)
        mean = statistics.fmean(kept) if kept else 0.0
        return statistics.fmean(self.tokens) / mean if mean > 0 else float("inf")


@dataclass
class _KindState:
    arms: dict[Arm, _Arm]
    current: Arm = Arm.SPECULATE  # the arm the measurements favour (optimistic at first)
    since_probe: int = 0  # steps of ``current`` since another arm last ran
    probe_every: int = MIN_PROBE_EVERY
    probing: Arm | None = None  # the arm a probe under way runs
    probe_run: int = 0  # steps of that probe so far
    next_probe: int = 0  # round robin over the other arms, for the periodic probes

    @classmethod
    def of(cls, kind: BatchKind) -> _KindState:
        return cls(arms={arm: _Arm() for arm in kind.arms})

    def others(self) -> list[Arm]:
        return [arm for arm in self.arms if arm is not self.current]

    def best(self) -> Arm:
        """The measured arm with the most tokens per row per second (the earlier on a tie)."""
        measured = [arm for arm, a in self.arms.items() if a.seconds]
        return max(measured, key=lambda arm: self.arms[arm].rate)


@dataclass
class SpeculationGate:
    """Chooses, per step, between speculating (with or without draft-side masks) and plain
    decoding (see the module doc)."""

    # False: always speculate as requested (benches replaying a recorded run step for step).
    enabled: bool = True
    kinds: dict[BatchKind, _KindState] = field(default_factory=dict)

    def choose(self, kind: BatchKind) -> Arm:
        """The arm for the next step of a batch of ``kind``; changes nothing (``record`` learns)."""
        state = self.kinds.get(kind)
        if state is None or not self.enabled:
            return Arm.SPECULATE
        if state.probing is not None:
            return state.probing  # the probe goes on
        current = state.arms[state.current]
        if state.current is Arm.SPECULATE and current.steps < WARMUP_STEPS:
            return Arm.SPECULATE
        others = state.others()
        unmeasured = [arm for arm in others if not state.arms[arm].seconds]
        if unmeasured:
            return unmeasured[-1]  # an arm's first measurement (plain decoding's first)
        if state.since_probe >= state.probe_every:
            return others[state.next_probe % len(others)]  # a periodic probe
        faster = max(others, key=lambda arm: state.arms[arm].rate)
        if current.rate < state.arms[faster].rate:
            return faster  # the current arm fell below another's last figure: measure that one now
        return state.current

    def record(self, kind: BatchKind, arm: Arm, *, seconds: float, rows: int, tokens: int) -> None:
        """Learn from one step of ``kind`` that ran ``arm``: ``seconds`` of wall clock, ``tokens``
        emitted over ``rows`` rows."""
        if rows <= 0 or seconds <= 0:
            return
        state = self.kinds.get(kind)
        if state is None:
            state = self.kinds[kind] = _KindState.of(kind)
        measured = state.arms.get(arm)
        if measured is None:
            return  # an arm this kind does not offer (a caller's own choice): nothing to learn
        if arm is state.current:
            measured.add(seconds, tokens / rows)
            state.since_probe += 1
            state.probing, state.probe_run = None, 0
            return
        if not state.arms[state.current].seconds:
            measured.add(seconds, tokens / rows)
            return  # nothing to compare with yet: its steps just add up
        if state.probing is not arm:
            measured.stale = True  # a probe starts: its steps replace the arm's old ones
            state.probing, state.probe_run = arm, 0
        measured.add(seconds, tokens / rows)
        state.probe_run += 1
        if state.probe_run < PROBE_STEPS:
            return  # the probe goes on
        best = state.best()
        if best is state.current:
            state.probe_every = min(MAX_PROBE_EVERY, 2 * state.probe_every)  # confirmed: probe less
            state.next_probe += 1
        else:
            state.current = best  # the probe's arm, measured faster just now
            state.probe_every = MIN_PROBE_EVERY
            state.next_probe = 0
        for other, figures in state.arms.items():
            if other is not best:
                figures.stale = True
        state.since_probe = 0
        state.probing, state.probe_run = None, 0
