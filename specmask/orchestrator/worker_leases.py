"""Which orchestrator drives which pooled GPU worker: leases held in one detached Ray actor.

Pooled workers (orchestrator.worker_pool, ``--worker-pool``) outlive the orchestrator that made
them, so the next one adopts them instead of loading the models again. A worker's batch must
have exactly one driver: each ``iterate()`` steps every sequence the worker holds and returns
their outputs to the caller, so two orchestrators driving one worker would each receive (and
drop) the other's tokens. A lease says who the driver is. The registry is one Ray actor: its
methods run one at a time, so a claim is atomic without locks.

A lease is held by renewing it (every ``ttl_s / 3``); an orchestrator that dies without
releasing loses its leases ``ttl_s`` later, and its workers become adoptable. A draining one
marks its leases *draining* (SIGTERM): a starting orchestrator waits for those workers instead
of creating new ones, which is what lets a rolling update hand workers over without a model
load. Names are reserved before an actor is created, so two orchestrators starting at once
never create (or adopt) the same worker.

The registry keeps its state in memory. If its actor is lost, a restarted one starts empty and
the next renewals rebuild it (``renew`` re-asserts a name no one else holds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

# Every pooled actor (workers and the registry) lives in this Ray namespace, whatever namespace
# the orchestrator's own Ray job has, so each orchestrator finds the others' workers by name.
RAY_NAMESPACE = "specmask"
REGISTRY_PREFIX = "specmask-worker-leases-"


@dataclass(frozen=True)
class Lease:
    owner: str
    expires_at: float  # the registry's monotonic clock
    draining: bool = False


@dataclass(frozen=True)
class LeaseView:
    """One name as a caller sees it (``WorkerLeases.snapshot``)."""

    name: str
    owner: str  # "" = free (never leased, released, or expired)
    draining: bool


class WorkerLeases:
    """The lease table of one worker pool (a plain class; ``registry`` makes it the Ray actor)."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}

    def _live(self, name: str, now: float) -> Lease | None:
        lease = self._leases.get(name)
        return lease if lease is not None and lease.expires_at > now else None

    def claim(self, owner: str, names: list[str], ttl_s: float) -> list[str]:
        """Lease each name that is free or already ``owner``'s; returns the names now held."""
        now = time.monotonic()
        held = []
        for name in names:
            lease = self._live(name, now)
            if lease is None or lease.owner == owner:
                self._leases[name] = Lease(owner, now + ttl_s)
                held.append(name)
        return held

    def renew(self, owner: str, names: list[str], ttl_s: float) -> list[str]:
        """Extend ``owner``'s leases (and take back a name no one holds, e.g. after the registry
        restarted empty); returns the names another owner holds now: ``owner`` must stop using them."""
        now = time.monotonic()
        lost = []
        for name in names:
            lease = self._live(name, now)
            if lease is not None and lease.owner != owner:
                lost.append(name)
                continue
            self._leases[name] = Lease(owner, now + ttl_s, draining=lease.draining if lease else False)
        return lost

    def drain(self, owner: str) -> None:
        """``owner`` is shutting down: its workers will be released soon; wait for them."""
        for name, lease in list(self._leases.items()):
            if lease.owner == owner:
                self._leases[name] = Lease(owner, lease.expires_at, draining=True)

    def release(self, owner: str, names: list[str]) -> None:
        for name in names:
            lease = self._leases.get(name)
            if lease is not None and lease.owner == owner:
                del self._leases[name]

    def snapshot(self) -> list[LeaseView]:
        now = time.monotonic()
        views = []
        for name in self._leases:
            lease = self._live(name, now)
            views.append(LeaseView(name, lease.owner if lease else "", lease.draining if lease else False))
        return views

    def forget(self, owner: str, names: list[str]) -> None:
        """The actors are gone (killed): drop their names, when ``owner`` holds them or no one does."""
        now = time.monotonic()
        for name in names:
            lease = self._live(name, now)
            if lease is None or lease.owner == owner:
                self._leases.pop(name, None)


def registry(pool: str) -> Any:
    """The pool's lease registry actor, created by the first orchestrator that asks (detached:
    it outlives every orchestrator; restarted by Ray if its process dies)."""
    import ray

    return (
        ray.remote(WorkerLeases)
        .options(
            name=REGISTRY_PREFIX + pool,
            namespace=RAY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=-1,
            num_cpus=0,
        )
        .remote()
    )
