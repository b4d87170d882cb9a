"""Worker supervision's decisions: probe pacing, replacement backoff and limits, what follows an
unanswered probe, and when a heartbeat that answers still means a hung worker."""

from __future__ import annotations

import itertools

import pytest

from specmask.orchestrator.supervision import (
    PROBE_MAX_S,
    PROBE_S,
    REPLACE_BACKOFF_MAX_S,
    REPLACE_BACKOFF_S,
    STALL_LIMITS,
    RecoveryStep,
    StallWatch,
    after_failed_probe,
    may_replace,
    next_probe_delay,
    replace_backoff,
)


def test_probes_double_up_to_the_cap_and_stay_there() -> None:
    delays = [PROBE_S]
    for _ in range(12):
        delays.append(next_probe_delay(delays[-1]))
    assert delays[:4] == [PROBE_S, 2 * PROBE_S, 4 * PROBE_S, 8 * PROBE_S]
    assert all(b >= a for a, b in itertools.pairwise(delays))
    assert max(delays) == PROBE_MAX_S == delays[-1]


def test_replacement_backoff_doubles_from_the_first_failed_start_up_to_the_cap() -> None:
    waits = [replace_backoff(n) for n in range(1, 12)]
    assert waits[0] == REPLACE_BACKOFF_S and waits[1] == 2 * REPLACE_BACKOFF_S
    assert all(b >= a for a, b in itertools.pairwise(waits))
    assert waits[-1] == REPLACE_BACKOFF_MAX_S
    assert replace_backoff(10_000) == REPLACE_BACKOFF_MAX_S  # no overflow, still capped


@pytest.mark.parametrize(
    ("can_replace", "restarts", "limit", "expected"),
    [
        (False, 0, -1, False),  # no replace_worker: only probing
        (True, 0, -1, True),
        (True, 10_000, -1, True),  # -1: no limit
        (True, 0, 0, False),  # 0: none at all
        (True, 2, 3, True),
        (True, 3, 3, False),
        (True, 4, 3, False),
    ],
)
def test_replacements_are_bounded_over_a_workers_life(
    can_replace: bool, restarts: int, limit: int, expected: bool
) -> None:
    assert may_replace(can_replace, restarts, limit) is expected


@pytest.mark.parametrize(
    ("dead", "replaceable", "lost_for_s", "expected"),
    [
        # A dead actor is replaced at once, or given up when it cannot be.
        (True, True, 0.0, RecoveryStep.REPLACE),
        (True, False, 0.0, RecoveryStep.GIVE_UP),
        (True, False, 1e9, RecoveryStep.GIVE_UP),
        # One that only does not answer may be restarting (Ray) or stuck: a liveness limit first.
        (False, True, 0.0, RecoveryStep.WAIT),
        (False, True, 29.9, RecoveryStep.WAIT),
        (False, True, 30.0, RecoveryStep.REPLACE),
        (False, False, 1e9, RecoveryStep.WAIT),  # not replaceable: probed for as long as it takes
    ],
)
def test_what_follows_an_unanswered_probe(
    dead: bool, replaceable: bool, lost_for_s: float, expected: RecoveryStep
) -> None:
    assert after_failed_probe(dead=dead, replaceable=replaceable, lost_for_s=lost_for_s, liveness_s=30.0) is expected


def test_a_slow_worker_whose_progress_moves_is_never_hung() -> None:
    limit = 5.0
    watch = StallWatch(limit, now=0.0)
    # One beat per liveness limit for far longer than the stall bound, the count moving each time.
    assert not any(watch.beat(count=i, now=i * limit) for i in range(10 * STALL_LIMITS))


def test_a_worker_whose_progress_stops_is_hung_after_the_stall_bound_not_before() -> None:
    limit = 5.0
    watch = StallWatch(limit, now=0.0)
    assert watch.beat(count=7, now=100.0) is False  # the first beat only starts the clock
    bound = STALL_LIMITS * limit
    assert watch.beat(count=7, now=100.0 + bound) is False  # exactly the bound: not yet
    assert watch.beat(count=7, now=100.0 + bound + 0.001) is True
    assert watch.moved_at == 100.0


def test_progress_after_a_long_stall_resets_the_clock() -> None:
    limit = 1.0
    watch = StallWatch(limit, now=0.0)
    watch.beat(count=1, now=0.0)
    assert watch.beat(count=1, now=STALL_LIMITS * limit) is False
    assert watch.beat(count=2, now=STALL_LIMITS * limit + 0.5) is False  # moved just in time
    assert watch.beat(count=2, now=2 * STALL_LIMITS * limit) is False
    assert watch.beat(count=2, now=2 * STALL_LIMITS * limit + 1.0) is True


def test_a_count_that_goes_back_counts_as_movement() -> None:
    """A restarted worker's count starts again from zero: that is progress, not a stall."""
    watch = StallWatch(1.0, now=0.0)
    watch.beat(count=500, now=0.0)
    assert watch.beat(count=0, now=1e6) is False
