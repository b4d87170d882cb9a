"""Acceptance by draft position: what each step's proposed and accepted counts add."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from specmask.orchestrator.draft_positions import DraftPositionMetrics


def test_a_step_with_no_drafts_or_odd_counts_reaches_nothing() -> None:
    """No drafts, or a negative count from a confused caller, counts no position: a negative n
    must not read as "all but the last" of the positions seen so far."""
    positions = DraftPositionMetrics(CollectorRegistry())
    positions.observe(proposed=3, accepted=3)
    positions.observe(proposed=0, accepted=0)
    positions.observe(proposed=-1, accepted=-2)
    assert positions.totals() == ({1: 1, 2: 1, 3: 1}, {1: 1, 2: 1, 3: 1})


def test_the_refused_position_is_reached_but_not_accepted() -> None:
    positions = DraftPositionMetrics(CollectorRegistry())
    positions.observe(proposed=5, accepted=1)  # position 2 verified and refused; 3.. never verified
    assert positions.totals() == ({1: 1, 2: 1}, {1: 1})
