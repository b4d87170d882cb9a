"""Engine-side state of one GPU worker actor: the requests placed on it, sent to it and finished
here, and whether it is in placement (docs/design.md, "Who runs what").

The engine's step loop (engine.py) fills and drains it, placement (placement.py) reads its load,
supervision (supervision.py) takes it out of placement and puts it back.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from specmask.gpu_worker.types import WorkerInfo
from specmask.orchestrator.request import Request


@dataclass(eq=False)
class WorkerSlot:
    """Engine-side state of one GPU worker actor."""

    index: int
    actor: Any  # ray.actor.ActorHandle of gpu_worker.actor.GpuWorker
    info: WorkerInfo
    capacity: int  # max active sequences (WorkerConfig.max_batch)
    running: dict[str, Request] = field(default_factory=dict)  # sent to the worker (add in flight or done)
    # Placed here, not sent yet: they go with the loop's next iterate() call (Engine._iterate).
    to_add: list[Request] = field(default_factory=list)
    to_remove: list[str] = field(default_factory=list)  # finished here; the worker still holds them
    healthy: bool = True
    gone: bool = False  # lost for good: dead with no replacement allowed, or replacements failed
    restarts: int = 0  # replacement actors started for it (supervision.WorkerSupervisor)
    # Being retired (Engine.retire_worker): out of placement, its batch finishing, never recovered.
    retiring: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Task | None = None  # closing a lost worker's mask sessions
    loop: asyncio.Task | None = None  # its step loop while one runs (Engine._run_worker)

    @property
    def placeable(self) -> bool:
        """Whether new requests may be placed here."""
        return self.healthy and not self.retiring

    @property
    def load(self) -> int:
        return len(self.running) + len(self.to_add)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the requests placed here and not finished (the token bound's batch)."""
        return sum(len(r.seq.prompt_token_ids) for r in (*self.running.values(), *self.to_add))

    def has_work(self) -> bool:
        return bool(self.running or self.to_remove or self.to_add)
