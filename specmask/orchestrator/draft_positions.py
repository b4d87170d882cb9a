"""Acceptance by draft position: the ``specmask_draft_position_*`` counters.

Position i (1-based) is *reached* in a step that proposed at least i drafts and accepted the
i - 1 before it; acceptance at i = accepted / reached, the conditional rate a longer draft
must beat to pay off (a lifetime acceptance ratio averages it away).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter


class PositionCounter:
    """A counter with a ``position`` label whose first n positions are counted together.

    Its children are made once each, as positions are first seen: a step's outputs would
    otherwise look labels up for every draft of every output."""

    def __init__(self, counter: Counter, *, first: int = 1, labels: Mapping[str, str] | None = None) -> None:
        self.counter = counter
        self._first = first  # the label of the first position: 1 for SpecMask's, 0 for vLLM's
        self._labels = dict(labels or {})  # the labels besides position, the same on every child
        self._children: list[Counter] = []

    def inc_first(self, n: int) -> None:
        """One more count at each of positions first .. first + n - 1 (none for n <= 0)."""
        if n <= 0:
            return
        while len(self._children) < n:
            position = str(len(self._children) + self._first)
            self._children.append(self.counter.labels(**self._labels, position=position))
        for child in self._children[:n]:
            child.inc()

    def totals(self) -> dict[int, int]:
        """Position -> its count so far."""
        out: dict[int, int] = {}
        for metric in self.counter.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out[int(sample.labels["position"])] = int(sample.value)
        return out


class DraftPositionMetrics:
    """How far into its drafts each step's verification reached, and what it accepted there."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.reached = PositionCounter(
            Counter(
                "specmask_draft_position_reached",
                "Draft positions verified after every earlier one",
                ["position"],
                registry=registry,
            )
        )
        self.accepted = PositionCounter(
            Counter("specmask_draft_position_accepted", "Draft positions accepted", ["position"], registry=registry)
        )

    def observe(self, proposed: int, accepted: int) -> None:
        """One sequence's step: ``proposed`` drafts, of which the first ``accepted`` were kept. The
        position after the last accepted one was reached too (verified, and refused), when proposed."""
        self.reached.inc_first(min(accepted + 1, proposed))
        self.accepted.inc_first(accepted)

    def totals(self) -> tuple[dict[int, int], dict[int, int]]:
        """(reached, accepted) per draft position so far."""
        return self.reached.totals(), self.accepted.totals()
