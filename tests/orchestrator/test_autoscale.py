"""The worker-count policy: sustained queue wait adds one, a sustained surplus removes one, never
outside [min, max], and nothing flaps around a threshold."""

from __future__ import annotations

import math

import pytest

from specmask.orchestrator.autoscale import AutoscalePolicy, LoadSample, WorkerAutoscaler

POLICY = AutoscalePolicy(
    min_workers=1, max_workers=3, scale_up_wait_s=2.0, scale_up_after_s=10.0, scale_down_idle_s=60.0, cooldown_s=30.0
)
BATCH = 4


def sample(now: float, workers: int, *, wait: float = 0.0, running: int = 0) -> LoadSample:
    return LoadSample(now=now, workers=workers, oldest_wait_s=wait, running=running, capacity_per_worker=BATCH)


def run(scaler: WorkerAutoscaler, start: float, end: float, workers: int, **load: float) -> tuple[float, int]:
    """Samples once a second from ``start`` until the count changes or ``end``; (time, count)."""
    t = start
    while t <= end:
        wanted = scaler.observe(sample(t, workers, **load))  # type: ignore[arg-type]
        if wanted != workers:
            return t, wanted
        t += 1.0
    return t, workers


def test_a_queue_that_stays_behind_adds_one_worker_after_the_sustain_time() -> None:
    scaler = WorkerAutoscaler(POLICY)
    at, wanted = run(scaler, 0.0, 100.0, 1, wait=5.0, running=BATCH)
    assert (at, wanted) == (10.0, 2)


def test_a_short_burst_adds_nothing() -> None:
    scaler = WorkerAutoscaler(POLICY)
    for t in range(9):  # above the threshold for 9 s, then drained
        assert scaler.observe(sample(float(t), 1, wait=5.0, running=BATCH)) == 1
    for t in range(9, 30):
        assert scaler.observe(sample(float(t), 1, wait=0.5, running=BATCH)) == 1
    # A new run starts from zero: 10 s more of waiting before a change.
    at, wanted = run(scaler, 30.0, 100.0, 1, wait=5.0, running=BATCH)
    assert (at, wanted) == (40.0, 2)


def test_wait_at_the_threshold_is_not_above_it() -> None:
    scaler = WorkerAutoscaler(POLICY)
    assert run(scaler, 0.0, 100.0, 1, wait=2.0, running=BATCH) == (101.0, 1)


def test_never_above_max_and_cooldown_between_changes() -> None:
    scaler = WorkerAutoscaler(POLICY)
    at, wanted = run(scaler, 0.0, 100.0, 1, wait=5.0, running=BATCH)
    assert (at, wanted) == (10.0, 2)
    # Still short: the next change waits out the cooldown (30 s after the last), not just 10 s.
    at, wanted = run(scaler, 11.0, 200.0, 2, wait=5.0, running=2 * BATCH)
    assert (at, wanted) == (40.0, 3)
    assert run(scaler, 41.0, 500.0, 3, wait=50.0, running=3 * BATCH) == (501.0, 3)


def test_idle_removes_one_after_the_idle_period_and_never_below_min() -> None:
    scaler = WorkerAutoscaler(POLICY)
    at, wanted = run(scaler, 0.0, 500.0, 3)
    assert (at, wanted) == (60.0, 2)
    at, wanted = run(scaler, 61.0, 500.0, 2)
    assert (at, wanted) == (121.0, 1)
    assert run(scaler, 122.0, 1000.0, 1) == (1001.0, 1)


def test_load_that_needs_every_worker_keeps_them() -> None:
    scaler = WorkerAutoscaler(POLICY)
    # 5 running on 2 workers of 4 slots: one worker cannot hold them.
    assert run(scaler, 0.0, 1000.0, 2, running=5) == (1001.0, 2)
    # 4 running fit one: after the idle period one goes.
    at, wanted = run(scaler, 1001.0, 2000.0, 2, running=4)
    assert (at, wanted) == (1061.0, 1)


def test_anything_waiting_blocks_a_scale_down() -> None:
    scaler = WorkerAutoscaler(POLICY)
    assert run(scaler, 0.0, 1000.0, 2, wait=0.1, running=0) == (1001.0, 2)


def test_alternating_load_does_not_flap() -> None:
    """Queue wait and idleness alternating faster than either sustain time: no change at all."""
    scaler = WorkerAutoscaler(POLICY)
    changes = 0
    for t in range(2000):
        busy = (t // 8) % 2 == 0
        s = sample(float(t), 2, wait=5.0 if busy else 0.0, running=2 * BATCH if busy else 0)
        changes += scaler.observe(s) != 2
    assert changes == 0


def test_out_of_bounds_goes_back_at_once() -> None:
    scaler = WorkerAutoscaler(POLICY)
    assert scaler.observe(sample(0.0, 0)) == 1
    assert scaler.observe(sample(1.0, 5, wait=100.0)) == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_workers": 0, "max_workers": 2},
        {"min_workers": 3, "max_workers": 2},
        {"min_workers": 1, "max_workers": 2, "scale_up_wait_s": -1.0},
        {"min_workers": 1, "max_workers": 2, "cooldown_s": math.nan},
    ],
)
def test_bad_policies_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        AutoscalePolicy(**kwargs)
