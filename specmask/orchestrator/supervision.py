"""Worker supervision: liveness, loss, recovery and replacement of GPU workers.

A call to a worker is waited for while its heartbeat answers and its progress count moves
(``await_live``); a worker that died or stopped answering is taken out of placement
(``WorkerSupervisor.on_failure``: the engine requeues or fails what it held, ``SupervisionHooks``)
and then probed until it answers again, or replaced by a new actor (bounded, with backoff); one
that cannot come back is given up. While no worker is healthy and one is being recovered,
queued and new requests wait for it up to ``EngineConfig.recovery_wait_s``. The decisions are
pure functions (``after_failed_probe``, ``replace_backoff``, ``StallWatch``) so they are tested
without Ray. See docs/design.md, "Who runs what".
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from ray.exceptions import ActorDiedError

from specmask.gpu_worker.types import LIVENESS_GROUP, WorkerInfo, WorkerProgress
from specmask.orchestrator.engine_config import EngineConfig
from specmask.orchestrator.errors import ShuttingDown, Unavailable
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.worker_calls import describe, ray_get
from specmask.orchestrator.worker_slot import WorkerSlot

logger = logging.getLogger(__name__)

# A lost worker is probed (info(), then reset()) at this interval, doubling up
# to the cap while it does not answer: Ray restarts a crashed actor in seconds
# (plus model loading); a hung one answers once its stuck call returns.
PROBE_S = 1.0
PROBE_MAX_S = 10.0
# Replacement actors started for one loss before the worker is given up, waiting this long
# after the first failed start, doubling up to the cap (a failed start is usually a lack of
# resources, e.g. the dead process's GPU memory not yet freed, which time cures).
REPLACE_ATTEMPTS = 5
REPLACE_BACKOFF_S = 2.0
REPLACE_BACKOFF_MAX_S = 30.0
# A worker whose heartbeat answers but whose progress count has not moved for this many
# liveness limits is hung (e.g. a deadlocked iteration), not slow: it is taken out.
STALL_LIMITS = 10

# replace_worker(actor): kills a lost worker's actor and starts a new one (worker_pool.replace_worker).
ReplaceWorker = Callable[[Any], Awaitable[tuple[Any, WorkerInfo]]]


class RecoveryStep(enum.Enum):
    """What recovery does after a probe of a lost worker went unanswered."""

    WAIT = "wait"  # probe again later (Ray may be restarting it, or a stuck call may return)
    REPLACE = "replace"  # kill its actor and start a new one
    GIVE_UP = "give_up"  # nothing can bring it back


def next_probe_delay(delay_s: float) -> float:
    """The wait before the next probe of a lost worker: doubling, up to ``PROBE_MAX_S``."""
    return min(2 * delay_s, PROBE_MAX_S)


def replace_backoff(failed_starts: int) -> float:
    """The wait after the ``failed_starts``-th replacement that failed to start (>= 1)."""
    # The exponent is capped first: 2 ** n past a float's range would raise, not saturate.
    return min(REPLACE_BACKOFF_S * 2.0 ** min(max(failed_starts, 1) - 1, 64), REPLACE_BACKOFF_MAX_S)


def may_replace(can_replace: bool, restarts: int, max_restarts: int) -> bool:
    """Whether another replacement actor may start for a worker that had ``restarts`` (limit
    ``max_restarts``; -1 = none) when the engine can start one at all."""
    return can_replace and (max_restarts < 0 or restarts < max_restarts)


def after_failed_probe(*, dead: bool, replaceable: bool, lost_for_s: float, liveness_s: float) -> RecoveryStep:
    """A lost worker did not answer a probe: replace it at once when its actor is dead for good,
    else once it has not answered for a liveness limit; give it up when dead and not replaceable."""
    if not replaceable:
        return RecoveryStep.GIVE_UP if dead else RecoveryStep.WAIT
    if not dead and lost_for_s < liveness_s:
        return RecoveryStep.WAIT
    return RecoveryStep.REPLACE


class StallWatch:
    """Progress counts a call's heartbeats read: hung once the count has not moved for
    ``STALL_LIMITS`` liveness limits (a worker merely slow keeps moving it)."""

    def __init__(self, limit_s: float, now: float) -> None:
        self._limit_s = limit_s
        self._last: int | None = None
        self.moved_at = now

    def beat(self, count: int, now: float) -> bool:
        """Record a heartbeat's count at ``now``; True when the worker is hung."""
        if self._last is None or count != self._last:
            self.moved_at = now
            self._last = count
            return False
        return now - self.moved_at > STALL_LIMITS * self._limit_s


async def await_live(slot: WorkerSlot, ref: Any, limit_s: float) -> Any:
    """Await a worker call for as long as the worker is alive and making progress.

    Every liveness limit (``limit_s``) the call has not answered, the worker's heartbeat is
    asked (``GpuWorker.progress``, answered on its own thread): a heartbeat that does not
    answer within the limit means the worker stopped (SIGSTOP, a wedged process or node) and
    raises TimeoutError; one that answers with a progress count that has not moved for
    ``STALL_LIMITS`` limits means a hung iteration, also TimeoutError. A worker that is merely
    slow (a long iteration on a busy CPU) is waited for."""
    call = asyncio.ensure_future(asyncio.wrap_future(ref.future()))
    started = time.monotonic()
    watch = StallWatch(limit_s, started)
    try:
        while True:
            done, _ = await asyncio.wait({call}, timeout=limit_s)
            if done:
                return call.result()
            beat = slot.actor.progress.options(concurrency_group=LIVENESS_GROUP).remote()
            progress: WorkerProgress = await ray_get(beat, limit_s)
            now = time.monotonic()
            if watch.beat(progress.count, now):
                raise TimeoutError(f"no progress in {now - watch.moved_at:.0f} s")
            logger.warning(
                "worker %d: call running for %.0f s; alive (progress %d, %d sequences)",
                slot.index,
                now - started,
                progress.count,
                progress.active,
            )
    finally:
        call.cancel()


class SupervisionHooks(Protocol):
    """What supervision asks of the engine, which owns the requests."""

    def worker_lost(self, slot: WorkerSlot, what: str) -> None:
        """``slot`` was taken out of placement (``what`` happened to it): requeue or fail what it held."""

    def worker_back(self, slot: WorkerSlot) -> None:
        """``slot`` is back in placement: start its step loop, place what waits."""

    def fail_waiting(self, message: str) -> None:
        """No worker is coming back within the wait: fail every queued request with ``message``."""

    def worker_gone(self, slot: WorkerSlot) -> None:
        """``slot`` was retired and is no longer among the workers: update the load it counted in."""


class WorkerSupervisor:
    """Takes lost workers out of placement and brings them back. Runs on the engine's loop."""

    def __init__(
        self,
        slots: list[WorkerSlot],
        config: EngineConfig,
        metrics: OrchestratorMetrics,
        hooks: SupervisionHooks,
        *,
        release_sessions: Callable[[str], int] | None = None,
        replace_worker: ReplaceWorker | None = None,
    ) -> None:
        """``slots``: the engine's workers (shared with it, and changed here as workers are added
        and retired).
        ``release_sessions(owner)``: closes every mask session a lost worker left open (blocking;
        returns how many); None leaves them to the mask service's idle TTL. ``replace_worker``:
        None = a lost worker is only probed until it answers again."""
        self._slots = slots
        self._config = config
        self._metrics = metrics
        self._hooks = hooks
        self._release_sessions = release_sessions
        self._replace_worker = replace_worker
        # Set while a worker is healthy, or when none is and none is being recovered any more:
        # requests waiting in wait_for_worker() for a replacement wait on it.
        self._worker_up = asyncio.Event()
        self._worker_up.set()
        # While no worker is healthy and one is being recovered: when the waiting ends (monotonic).
        self._down_deadline: float | None = None
        self._on_health_change: Callable[[bool], None] | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._next_index = max((s.index for s in slots), default=-1) + 1

    def set_health_listener(self, listener: Callable[[bool], None]) -> None:
        """Called with False when the last healthy worker is lost, True when one is back."""
        self._on_health_change = listener

    def release_waiters(self) -> None:
        """Wake the requests waiting for a worker, to be refused (draining or stopping)."""
        self._worker_up.set()

    def stop(self) -> list[asyncio.Task]:
        """Stop recovering, at once: cancel the probes, replacements and session releases in
        flight, and return them for the caller to await."""
        self._stopping = True
        self._worker_up.set()
        for task in self._tasks:
            task.cancel()
        return list(self._tasks)

    @property
    def healthy(self) -> bool:
        return not self._stopping and any(s.healthy for s in self._slots)

    @property
    def recovering(self) -> bool:
        """No healthy worker, but a lost one is being recovered or replaced and the wait for
        it (``EngineConfig.recovery_wait_s``) has not run out: requests wait instead of failing."""
        return (
            not self._stopping
            and not self.healthy
            and self._down_deadline is not None
            and time.monotonic() < self._down_deadline
            and any(not s.healthy and not s.gone for s in self._slots)
        )

    async def wait_for_worker(self, refused: Callable[[], bool]) -> None:
        """Wait (bounded) for a healthy worker while a lost one is recovered; ShuttingDown once
        ``refused()`` (the engine drains or stops), Unavailable if no worker is being recovered
        or none comes back within the recovery wait."""
        while not self.healthy:
            if self._stopping or refused():
                raise ShuttingDown("the server is shutting down")
            if not self.recovering:
                raise Unavailable(self.no_worker_message())
            assert self._down_deadline is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._worker_up.wait(), max(0.0, self._down_deadline - time.monotonic()))

    def no_worker_message(self) -> str:
        if any(not s.gone for s in self._slots) and self._config.recovery_wait_s > 0:
            return (
                f"no healthy GPU worker: none came back within {self._config.recovery_wait_s:g} s "
                "(a lost worker is being replaced); retry"
            )
        return "no healthy GPU worker left"

    # ---- adding and retiring workers -----------------------------------

    def add(self, actor: Any, info: WorkerInfo, capacity: int) -> WorkerSlot:
        """Put a newly started worker (loaded: ``info`` is its answer) into placement with a step
        loop of its own (the engine's, ``SupervisionHooks.worker_back``). A worker serving another
        model is refused (ValueError): its outputs would not be the others'."""
        if self._slots and not info.serves_same_model(self._slots[0].info):
            raise ValueError(f"the new worker serves a different model than the others: {info}")
        was_down = not self.healthy
        slot = WorkerSlot(index=self._next_index, actor=actor, info=info, capacity=capacity)
        self._next_index += 1
        self._slots.append(slot)
        logger.warning("worker %d added (pid %d)", slot.index, info.pid)
        self._up(slot, was_down)
        return slot

    async def retire(self) -> Any | None:
        """Take the least-loaded worker out of placement, let its batch finish (no request is cut
        off or moved), wait for its step loop to end and return its actor, for the caller to
        stop; None when none can go (the last worker in placement never does) or the engine
        stops meanwhile. A retiring worker that is lost is not recovered."""
        placeable = [s for s in self._slots if s.placeable]
        if len(placeable) < 2:
            return None
        slot = min(placeable, key=lambda s: s.load)
        slot.retiring = True
        logger.warning("worker %d retiring: out of placement, finishing its %d requests", slot.index, slot.load)
        slot.wake.set()  # an idle loop sees it has nothing left and ends
        if slot.loop is not None:
            await asyncio.wait({slot.loop})  # ends once its batch is done, or the worker is lost
        if self._stopping:
            return None
        self._slots.remove(slot)
        self._metrics.healthy_workers.set(sum(s.healthy for s in self._slots))
        self._hooks.worker_gone(slot)
        logger.warning("worker %d retired", slot.index)
        return slot.actor

    # ---- loss ------------------------------------------------------------

    def on_failure(self, slot: WorkerSlot, exc: BaseException) -> None:
        """The worker died or stopped answering: take it out, have the engine requeue or fail what
        it held, start recovering it. Once per loss: a slot already out (e.g. its loop's call
        fails after placement found it broken) is being recovered already."""
        if not slot.healthy:
            logger.info("worker %d: already out of placement: %s", slot.index, describe(exc))
            return
        timed_out = isinstance(exc, (asyncio.TimeoutError, TimeoutError))
        logger.error(
            "worker %d %s; taking it out of placement", slot.index, "timed out" if timed_out else f"failed: {exc!r}"
        )
        # The client gets what happened in SpecMask's words; Ray's exception text
        # ("ActorUnavailableError ... recvmsg") stays in the log above.
        what = (
            f"stopped answering (no heartbeat or no progress within {self._config.step_timeout_s:g} s)"
            if timed_out
            else "was lost (its process died or became unreachable)"
        )
        slot.healthy = False
        self._metrics.worker_failures.labels(worker=str(slot.index)).inc()
        self._hooks.worker_lost(slot, what)
        if self._release_sessions is not None and slot.info.session_owner and not self._stopping:
            # Its requests are finished, so their mask sessions are garbage. Release them
            # now: a worker that never comes back (restarts used up, or hung) would
            # otherwise hold them until the service's idle TTL.
            slot.release = self._spawn(self._release_worker_sessions(slot), f"worker-{slot.index}-release")
        healthy = sum(s.healthy for s in self._slots)
        self._metrics.healthy_workers.set(healthy)
        if not healthy:
            self._worker_up.clear()
            if self._on_health_change is not None:
                self._on_health_change(False)
            if not self._stopping and self._config.recovery_wait_s > 0:
                # What is queued waits for the recovery below, up to the bound.
                self._down_deadline = time.monotonic() + self._config.recovery_wait_s
                self._spawn(self._end_wait(self._down_deadline), "recovery-wait")
            else:
                self._fail_waiting()
        if not self._stopping and not slot.retiring:  # a retiring worker is not wanted back
            self._spawn(self._recover(slot), f"worker-{slot.index}-recover")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    def _fail_waiting(self) -> None:
        """No worker is healthy and none is coming back within the wait: fail what is queued
        (submit() refuses new requests), and wake the requests waiting in submit()."""
        self._hooks.fail_waiting(self.no_worker_message())
        self._down_deadline = None
        self._worker_up.set()  # waiters re-check, and are refused

    async def _end_wait(self, deadline: float) -> None:
        """At the end of the recovery wait: if still no worker is healthy, fail what waits."""
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        if self._down_deadline == deadline and not self.healthy and not self._stopping:
            logger.error("no GPU worker back within %g s; failing the queued requests", self._config.recovery_wait_s)
            self._fail_waiting()

    async def _release_worker_sessions(self, slot: WorkerSlot) -> None:
        assert self._release_sessions is not None
        try:
            closed = await asyncio.to_thread(self._release_sessions, slot.info.session_owner)
        except Exception as exc:  # the sessions then expire by TTL
            logger.warning("worker %d: releasing its mask sessions failed: %s", slot.index, exc)
            return
        logger.info("worker %d: released %d mask sessions it held", slot.index, closed)

    # ---- recovery --------------------------------------------------------

    async def _recover(self, slot: WorkerSlot) -> None:
        """Bring a lost worker back: probe it until it answers (Ray restarted a crashed actor, a
        stopped process continued), or replace it (``after_failed_probe``). Replacements are
        bounded (``REPLACE_ATTEMPTS`` per loss, with backoff; ``EngineConfig.max_restarts`` over
        the worker's life); a worker that cannot come back is given up (``WorkerSlot.gone``).
        Once back it is reset, checked to serve the same model, and put back into placement."""
        lost_at = time.monotonic()
        delay = PROBE_S
        failed_starts = 0
        limit = self._config.step_timeout_s
        while not self._stopping:
            await asyncio.sleep(delay)
            delay = next_probe_delay(delay)
            try:
                info: WorkerInfo = await ray_get(slot.actor.info.remote(), limit)
                # Requests it held were failed already; a restarted actor holds none,
                # a hung one that came back still does.
                freed = await ray_get(slot.actor.reset.remote(), limit)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                dead = isinstance(exc, ActorDiedError)
                logger.info("worker %d not back yet%s: %s", slot.index, " (dead)" if dead else "", describe(exc))
                replaceable = may_replace(self._replace_worker is not None, slot.restarts, self._config.max_restarts)
                step = after_failed_probe(
                    dead=dead, replaceable=replaceable, lost_for_s=time.monotonic() - lost_at, liveness_s=limit
                )
                if step is RecoveryStep.GIVE_UP:  # nothing can bring it back
                    self._give_up(slot, "its actor is dead and no restart is left (--worker-max-restarts)")
                    return
                if step is RecoveryStep.WAIT:
                    continue
                try:
                    info = await self._start_replacement(slot)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    failed_starts += 1
                    logger.error(
                        "worker %d: starting a replacement failed (%d of %d): %s",
                        slot.index,
                        failed_starts,
                        REPLACE_ATTEMPTS,
                        describe(exc),
                    )
                    if failed_starts >= REPLACE_ATTEMPTS:
                        self._give_up(slot, f"{REPLACE_ATTEMPTS} replacements failed to start")
                        return
                    delay = replace_backoff(failed_starts)
                    continue
                freed = 0
            if not info.serves_same_model(slot.info):
                logger.error("worker %d came back with a different model (%s); leaving it out", slot.index, info)
                self._give_up(slot, "it came back with a different model")
                return
            if slot.release is not None:
                # Finish releasing the old sessions first: once the worker is back in
                # placement, its owner's sessions are live ones.
                await slot.release
                slot.release = None
            self._put_back(slot, info, freed)
            return

    def _put_back(self, slot: WorkerSlot, info: WorkerInfo, freed: int) -> None:
        was_down = not self.healthy
        slot.info = info
        slot.healthy = True
        self._metrics.worker_recoveries.labels(worker=str(slot.index)).inc()
        logger.warning("worker %d is back (pid %d, freed %d stale sequences)", slot.index, info.pid, freed)
        self._up(slot, was_down)

    def _up(self, slot: WorkerSlot, was_down: bool) -> None:
        """``slot`` (healthy) joins placement: requests waiting for a worker go on, readiness
        turns back on if no worker was healthy, the engine starts its loop."""
        self._down_deadline = None
        self._worker_up.set()
        self._metrics.healthy_workers.set(sum(s.healthy for s in self._slots))
        if was_down and self._on_health_change is not None:
            self._on_health_change(True)
        self._hooks.worker_back(slot)

    async def _start_replacement(self, slot: WorkerSlot) -> WorkerInfo:
        """Kill the lost worker's actor and start a new one in its slot (counted once started)."""
        assert self._replace_worker is not None
        logger.warning("worker %d: replacing its actor (restart %d)", slot.index, slot.restarts + 1)
        actor, info = await self._replace_worker(slot.actor)
        slot.actor = actor
        slot.restarts += 1
        self._metrics.worker_restarts.labels(worker=str(slot.index)).inc()
        return info

    def _give_up(self, slot: WorkerSlot, why: str) -> None:
        """The worker will not come back: leave it out for good; with no other worker healthy or
        recovering, fail what waits for one."""
        logger.error("worker %d is lost for good: %s", slot.index, why)
        slot.gone = True
        if not self.healthy and not any(not s.healthy and not s.gone for s in self._slots):
            self._fail_waiting()
