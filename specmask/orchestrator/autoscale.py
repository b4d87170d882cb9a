"""How many GPU workers the load asks for: queue-wait and load samples in, a worker count out.

A pure policy (no Ray, no clock of its own): ``WorkerAutoscaler.observe`` takes one
``LoadSample`` at a time and returns the worker count wanted now, always within
``[min_workers, max_workers]``. The wiring that creates and retires workers
(orchestrator.worker_scaling) asks it once a tick.

Up: the oldest waiting request has waited longer than ``scale_up_wait_s`` in every sample for
``scale_up_after_s``: one worker more. A burst that the batch absorbs in a second or two moves
nothing; a queue that stays behind does. A worker that is still starting counts as a worker,
so a long model load (or a GPU pod the cluster autoscaler is still adding) is not answered
with another and another.

Down: the requests in the batches fit in one worker fewer, and nothing waits, in every sample
for ``scale_down_idle_s``: one worker fewer. Never down while anything waits, so a change up
and a change down never follow each other around one threshold; after any change both clocks
start again (``cooldown_s`` at least), which is the hysteresis.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscalePolicy:
    min_workers: int
    max_workers: int
    # The oldest waiting request's wait above which the pool is short of workers...
    scale_up_wait_s: float = 2.0
    # ...when it stays above it for this long.
    scale_up_after_s: float = 10.0
    # The load fits in one worker fewer, with nothing waiting, for this long: one goes.
    scale_down_idle_s: float = 120.0
    # No second change within this long of the last one (a new worker needs time to take load).
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {self.min_workers}, {self.max_workers}")
        for name in ("scale_up_wait_s", "scale_up_after_s", "scale_down_idle_s", "cooldown_s"):
            value = getattr(self, name)
            if not value >= 0:  # also refuses NaN
                raise ValueError(f"{name} must be >= 0, got {value}")

    def clamp(self, workers: int) -> int:
        return max(self.min_workers, min(self.max_workers, workers))


@dataclass(frozen=True)
class LoadSample:
    now: float  # monotonic seconds
    workers: int  # workers in the pool, serving or starting (not ones being retired)
    oldest_wait_s: float  # how long the oldest waiting request has waited; 0 = none waits
    running: int  # requests placed on the workers (in their batches)
    capacity_per_worker: int  # batch slots of one worker

    def fits_one_fewer(self) -> bool:
        return self.oldest_wait_s <= 0 and self.running <= (self.workers - 1) * self.capacity_per_worker


class WorkerAutoscaler:
    """Hysteresis over load samples; one instance per worker pool."""

    def __init__(self, policy: AutoscalePolicy) -> None:
        self.policy = policy
        self._short_since: float | None = None  # first sample of the current run above the wait threshold
        self._surplus_since: float | None = None  # first sample of the current run that fits one fewer
        self._changed_at: float | None = None

    def observe(self, sample: LoadSample) -> int:
        """The worker count wanted after this sample (the sample's own count when nothing changes)."""
        policy = self.policy
        if sample.workers != policy.clamp(sample.workers):
            # Out of bounds (a worker lost for good, or bounds changed): back within them at once.
            return self._change(sample, policy.clamp(sample.workers))
        self._short_since = _run_start(self._short_since, sample.now, sample.oldest_wait_s > policy.scale_up_wait_s)
        self._surplus_since = _run_start(self._surplus_since, sample.now, sample.fits_one_fewer())
        if self._changed_at is not None and sample.now - self._changed_at < policy.cooldown_s:
            return sample.workers
        short = self._short_since is not None and sample.now - self._short_since >= policy.scale_up_after_s
        if short and sample.workers < policy.max_workers:
            return self._change(sample, sample.workers + 1)
        surplus = self._surplus_since is not None and sample.now - self._surplus_since >= policy.scale_down_idle_s
        if surplus and sample.workers > policy.min_workers:
            return self._change(sample, sample.workers - 1)
        return sample.workers

    def _change(self, sample: LoadSample, workers: int) -> int:
        self._changed_at = sample.now
        self._short_since = None
        self._surplus_since = None
        return workers


def _run_start(since: float | None, now: float, holds: bool) -> float | None:
    """When the current run of samples for which a condition holds began; None = it does not hold."""
    if not holds:
        return None
    return now if since is None else since
