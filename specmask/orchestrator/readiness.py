"""What the orchestrator's readiness reports: can it serve a constrained request right now?

Ready means both:

* at least one GPU worker is healthy (the engine's view: a worker that misses
  its step timeout, e.g. one stopped with SIGSTOP, is taken out), and
* at least one mask-service replica answers its gRPC health check SERVING.

Before this, health stayed SERVING with every mask replica dead while every
new grammar request failed UNAVAILABLE. The mask tier is probed on a timer
(``interval_s``), every replica in parallel, each with a short deadline; the
engine pokes a re-check at once when its worker health changes. Only changes
are published (``publish(ready)``), so the server keeps one place that maps
readiness to health service names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmask.mask_service.client.replicas import ReplicaSet

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0  # a dead mask tier shows as NOT_SERVING within ~interval + timeout
DEFAULT_PROBE_TIMEOUT_S = 1.0


class MaskTierProbe:
    """Health-checks every mask replica; True when any answers SERVING."""

    def __init__(self, targets: Sequence[str], *, timeout_s: float = DEFAULT_PROBE_TIMEOUT_S) -> None:
        self._replicas = ReplicaSet(list(targets))
        self._timeout = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def _serving(self, address: str) -> bool:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self._timeout
            )
        except grpc.RpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    async def reachable(self) -> int:
        """How many replicas answer SERVING now."""
        addresses = self._replicas.addresses()
        if not addresses:
            await asyncio.to_thread(self._replicas.refresh)
            addresses = self._replicas.addresses()
        results = await asyncio.gather(*(self._serving(a) for a in addresses))
        return sum(results)

    async def close(self) -> None:
        self._replicas.close()
        for channel in self._channels.values():
            await channel.close()


class Readiness:
    """Combines worker health and mask-tier reachability; publishes changes."""

    def __init__(
        self,
        workers_healthy: Callable[[], bool],
        probe: MaskTierProbe,
        publish: Callable[[bool], None],
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self._workers_healthy = workers_healthy
        self._probe = probe
        self._publish = publish
        self._interval = interval_s
        self._poke = asyncio.Event()
        self.ready: bool | None = None  # None until the first check
        self.mask_replicas_serving = 0
        self._task: asyncio.Task[None] | None = None

    def poke(self, *_: object) -> None:
        """Re-check now (the engine calls this when worker health changes); loop-thread only."""
        self._poke.set()

    async def check(self) -> bool:
        workers = self._workers_healthy()
        self.mask_replicas_serving = await self._probe.reachable()
        ready = workers and self.mask_replicas_serving > 0
        if ready != self.ready:
            if self.ready is not None or not ready:
                logger.warning(
                    "readiness -> %s (healthy workers: %s, mask replicas serving: %d)",
                    "SERVING" if ready else "NOT_SERVING",
                    workers,
                    self.mask_replicas_serving,
                )
            self.ready = ready
            self._publish(ready)
        return ready

    async def _run(self) -> None:
        while True:
            try:
                await self.check()
            except Exception:  # a probe bug must not end readiness checks for good
                logger.exception("readiness check failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self._interval)
            self._poke.clear()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._probe.close()
