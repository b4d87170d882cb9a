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

    SPECULATE = enum.auto()  # k_r as planned
    PLAIN = enum.auto()  # k_r = 0 for every row


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

    @classmethod
    def of(cls, size: int, *, constrained: bool, draft_masks: bool, sampled: bool = False) -> BatchKind:
        return cls(1 << max(0, size - 1).bit_length(), constrained, draft_masks, sampled)


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
    arms: dict[Arm, _Arm] = field(default_factory=lambda: {arm: _Arm() for arm in Arm})
    current: Arm = Arm.SPECULATE  # the arm the measurements favour (optimistic at first)
    since_probe: int = 0  # steps of ``current`` since the other arm last ran
    probe_every: int = MIN_PROBE_EVERY
    other_run: int = 0  # steps of the other arm in a row (a probe under way)


@dataclass
class SpeculationGate:
    """Chooses, per step, between speculating and plain decoding (see the module doc)."""

    # False: always speculate (benches replaying a recorded run step for step).
    enabled: bool = True
    kinds: dict[BatchKind, _KindState] = field(default_factory=dict)

    def choose(self, kind: BatchKind) -> Arm:
        """The arm for the next step of a batch of ``kind``; changes nothing (``record`` learns)."""
        state = self.kinds.get(kind)
        if state is None or not self.enabled:
            return Arm.SPECULATE
        if state.other_run:
            return Arm.PLAIN if state.current is Arm.SPECULATE else Arm.SPECULATE  # the probe goes on
        spec, plain = state.arms[Arm.SPECULATE], state.arms[Arm.PLAIN]
        if state.current is Arm.PLAIN:
            return Arm.SPECULATE if state.since_probe >= state.probe_every else Arm.PLAIN
        if spec.steps < WARMUP_STEPS:
            return Arm.SPECULATE
        if not plain.seconds or state.since_probe >= state.probe_every or spec.rate < plain.rate:
            return Arm.PLAIN  # the plain step's first measurement, a probe, or speculation fell below it
        return Arm.SPECULATE

    def record(self, kind: BatchKind, arm: Arm, *, seconds: float, rows: int, tokens: int) -> None:
        """Learn from one step of ``kind`` that ran ``arm``: ``seconds`` of wall clock, ``tokens``
        emitted over ``rows`` rows."""
        if rows <= 0 or seconds <= 0:
            return
        state = self.kinds.setdefault(kind, _KindState())
        measured = state.arms[arm]
        if arm is state.current:
            measured.add(seconds, tokens / rows)
            state.since_probe += 1
            state.other_run = 0
            return
        if not state.arms[state.current].seconds:
            measured.add(seconds, tokens / rows)
            return  # nothing to compare with yet: its steps just add up
        if state.other_run == 0:
            measured.stale = True  # a probe starts: its steps replace the arm's old ones
        measured.add(seconds, tokens / rows)
        state.other_run += 1
        if state.other_run < PROBE_STEPS:
            return  # the probe goes on
        spec, plain = state.arms[Arm.SPECULATE], state.arms[Arm.PLAIN]
        best = Arm.SPECULATE if spec.rate >= plain.rate else Arm.PLAIN
        if best is state.current:
            state.probe_every = min(MAX_PROBE_EVERY, 2 * state.probe_every)  # confirmed: probe less
        else:
            state.current = best  # the probe's arm, measured faster just now
            state.probe_every = MIN_PROBE_EVERY
        state.arms[Arm.PLAIN if best is Arm.SPECULATE else Arm.SPECULATE].stale = True
        state.since_probe = 0
        state.other_run = 0
