"""Restart crashed mask-service replicas of a local stack (`specmask up`), as a Deployment would.

Before this, a replica killed under `specmask up` stayed dead and every grammar
request failed UNAVAILABLE until the stack was restarted. The supervisor looks
at each replica process every ``interval_s``; one that exited without being
stopped on purpose is started again on its address (the routers' reconnect
backoff is capped at 2 s, so it is used again within seconds). Restarts back
off exponentially per replica, so a replica that crashes at start-up cannot
spin the CPU.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Protocol

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
MIN_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# A replica that served this long since its last restart gets its backoff reset.
STABLE_AFTER_S = 60.0


class Restartable(Protocol):
    """What the supervisor needs of a replica (local_stack.MaskServiceProcess)."""

    address: str

    @property
    def running(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stopped_on_purpose(self) -> bool: ...

    def start(self, *, wait: bool = True) -> object: ...


class ReplicaSupervisor:
    def __init__(self, replicas: Sequence[Restartable], *, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self._replicas = list(replicas)
        self._interval = interval_s
        self._backoff = [MIN_BACKOFF_S] * len(self._replicas)
        self._next_try = [0.0] * len(self._replicas)
        self._last_start = [time.monotonic()] * len(self._replicas)
        self.restarts = 0
        self._task: asyncio.Task[None] | None = None

    def check_once(self) -> int:
        """Restart the replicas that died; returns how many were restarted now."""
        now = time.monotonic()
        restarted = 0
        for i, r in enumerate(self._replicas):
            if r.running:
                if now - self._last_start[i] > STABLE_AFTER_S:
                    self._backoff[i] = MIN_BACKOFF_S
                continue
            if r.stopped_on_purpose or now < self._next_try[i]:
                continue
            logger.warning("mask replica %s exited (status %s); restarting it", r.address, r.returncode)
            try:
                r.start(wait=False)
            except OSError:
                logger.exception("restart of mask replica %s failed", r.address)
            self._last_start[i] = now
            self._next_try[i] = now + self._backoff[i]
            self._backoff[i] = min(MAX_BACKOFF_S, self._backoff[i] * 2)
            self.restarts += 1
            restarted += 1
        return restarted

    async def _run(self) -> None:
        while True:
            self.check_once()
            await asyncio.sleep(self._interval)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
