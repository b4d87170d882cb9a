"""GPU workers that follow the load: the autoscale policy's count carried out at run time.

Once a tick (``tick_s``) the scaler reads the engine's load (``PoolLoad``), asks the policy
(orchestrator.autoscale) for a worker count, and makes one change at a time:

* up: the pool starts a worker (worker_pool.WorkerPool.add; on Kubernetes its GPU request is
  what makes KubeRay's autoscaler add a GPU pod), and once it has loaded the engine puts it into
  placement. While it starts it counts as a worker, so a long load is not answered with more.
* down: the engine takes the least-loaded worker out of placement, lets its batch finish (no
  request is cut off or moved), and only then the pool kills it, freeing its GPU.

A change that fails (no GPU within the start timeout, a load error) is logged and counted; the
policy's cooldown spaces the next try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from specmask.gpu_worker.types import WorkerInfo
from specmask.orchestrator.autoscale import AutoscalePolicy, LoadSample, WorkerAutoscaler

logger = logging.getLogger(__name__)

# How often the load is sampled: the policy's sustain times are seconds to minutes.
DEFAULT_TICK_S = 1.0


@dataclass(frozen=True)
class PoolLoad:
    """What the engine reports to the scaler (Engine.pool_load)."""

    workers: int  # workers in placement or being recovered (not retiring, not given up)
    oldest_wait_s: float  # the oldest admitted request still waiting for a batch slot; 0 = none
    running: int  # requests placed on workers


class ScalableEngine(Protocol):
    def pool_load(self) -> PoolLoad: ...

    def add_worker(self, actor: Any, info: WorkerInfo, capacity: int) -> Any: ...

    async def retire_worker(self) -> Any | None:
        """Take one worker out of placement, wait for its batch to finish, and return its actor
        (None when none can go)."""
        ...


class ScalablePool(Protocol):
    async def add(self) -> tuple[Any, WorkerInfo]: ...

    async def retire(self, actor: Any) -> None: ...


class WorkerScaler:
    def __init__(
        self,
        engine: ScalableEngine,
        pool: ScalablePool,
        policy: AutoscalePolicy,
        capacity_per_worker: int,
        *,
        tick_s: float = DEFAULT_TICK_S,
    ) -> None:
        self._engine = engine
        self._pool = pool
        self._policy = WorkerAutoscaler(policy)
        self._capacity = capacity_per_worker
        self._tick_s = tick_s
        self._change: asyncio.Task | None = None
        self._starting = 0
        self._task: asyncio.Task | None = None
        self.added = 0  # workers added / retired over this scaler's life (tests, logs)
        self.retired = 0
        self.failed = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="worker-scaler")

    async def stop(self) -> None:
        """Stop scaling; a change in flight is cancelled (a worker still starting is retired by
        its own add(), one being retired finishes its batch first: the engine's drain covers it)."""
        for task in (self._task, self._change):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    @property
    def policy(self) -> AutoscalePolicy:
        return self._policy.policy

    @property
    def tick_s(self) -> float:
        return self._tick_s

    @property
    def busy(self) -> bool:
        """A change (a worker starting, or one retiring until its actor is killed) is in flight."""
        return self._change is not None and not self._change.done()

    def sample(self, now: float) -> LoadSample:
        load = self._engine.pool_load()
        return LoadSample(
            now=now,
            workers=load.workers + self._starting,
            oldest_wait_s=load.oldest_wait_s,
            running=load.running,
            capacity_per_worker=self._capacity,
        )

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            if self.busy:
                continue
            sample = self.sample(time.monotonic())
            wanted = self._policy.observe(sample)
            if wanted > sample.workers:
                self._change = asyncio.create_task(self._add(), name="worker-scale-up")
            elif wanted < sample.workers:
                self._change = asyncio.create_task(self._retire(), name="worker-scale-down")

    async def _add(self) -> None:
        self._starting += 1
        logger.warning("worker autoscaling: the queue wait stays high; starting a worker")
        try:
            actor, info = await self._pool.add()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failed += 1
            logger.error("worker autoscaling: starting a worker failed: %s", exc)
            return
        finally:
            self._starting -= 1
        try:
            slot = self._engine.add_worker(actor, info, self._capacity)
        except Exception as exc:  # e.g. it loaded a different model: never put it into placement
            self.failed += 1
            logger.error("worker autoscaling: the new worker was refused: %s", exc)
            await self._pool.retire(actor)
            return
        self.added += 1
        logger.warning("worker autoscaling: worker %s added (pid %d)", getattr(slot, "index", "?"), info.pid)

    async def _retire(self) -> None:
        logger.warning("worker autoscaling: the load fits one worker fewer; retiring one")
        actor = await self._engine.retire_worker()
        if actor is None:
            return
        try:
            await self._pool.retire(actor)
        except Exception as exc:  # out of placement already; its actor may linger until Ray reaps it
            logger.error("worker autoscaling: killing the retired worker failed: %s", exc)
        self.retired += 1
        logger.warning("worker autoscaling: worker retired")
