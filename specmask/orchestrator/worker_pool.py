"""Ray connection and GPU worker actors: start them, wait for them, stop them; pooled ones adopted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specmask.gpu_worker.types import WorkerInfo
from specmask.orchestrator.config import OrchestratorConfig
from specmask.orchestrator.worker_leases import RAY_NAMESPACE, LeaseView, registry
from specmask.orchestrator.worker_slot import WorkerSlot

logger = logging.getLogger(__name__)

# A local Ray on a shared small box: bind to 127.0.0.1, no auth prompts, no
# usage-stats phone-home (shared/data/README.md). Only set when unset.
_LOCAL_RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray starts workers at nice 15 (it expects spare cores). Locally the GpuWorker actor
    # is the process doing the model work, and on a small shared box nice 15 starved it
    # behind the mask service and the orchestrator (the demo ran several times slower).
    "RAY_worker_niceness": "0",
    # The GCS writes its port to a file the driver waits for, 30 s by default; on a saturated
    # box (parallel test workers, a shared CI machine) its start can take longer than that.
    "RAY_gcs_server_port_wait_time_s": "120",
    # A new node's raylet has 30 s by default to register with the GCS; the same saturation
    # can take longer, and then `ray start` / ray.init fails though nothing is wrong.
    "RAY_raylet_start_wait_time_s": "120",
    # Ray prestarts a pool of idle task workers (one per CPU) that the local stack never uses:
    # its work runs in actors. Each is a Python process importing Ray, seconds of CPU a start.
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
}
# Step outputs are a few hundred bytes; the default store (30% of RAM) would
# only take memory from the models.
_LOCAL_OBJECT_STORE_BYTES = 100 * 1024**2
# GpuWorker.shutdown closes its mask sessions: a few RPCs.
_SHUTDOWN_TIMEOUT_S = 10.0
# Ray gives a new local node a fixed 30 s to register its raylet with the GCS, and waits a
# limited time for the GCS's port file. On a saturated host (a shared CI box) either can pass
# with nothing wrong; a fresh attempt usually starts in time.
_LOCAL_START_ATTEMPTS = 3
_START_TIMEOUT_TEXTS = ("timed out during startup", "Timed out waiting for file")


def _local_ray_on_loopback() -> None:
    """A local Ray's servers (GCS, raylet, workers) listen on 127.0.0.1 only.

    Ray binds loopback when it is told it runs no cluster (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
    set above for the processes it starts), but this process's ray_constants read that
    variable once, when ray was first imported (the engine imports ray.exceptions), so the
    constant is set here too. Without it every Ray port listened on all interfaces."""
    from ray._private import ray_constants

    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
        ray_constants.ENABLE_RAY_CLUSTER = False


def connect_ray(address: str, *, log_to_driver: bool = True, join_timeout_s: float = 0.0) -> bool:
    """Join Ray; ``"local"`` starts an in-process cluster. Returns True if this call started Ray.

    Call it from the main thread: Ray installs its signal handlers there.
    ``log_to_driver=False`` keeps worker output out of this process's terminal.
    ``join_timeout_s``: how long a cluster that refuses or times out the connection is tried
    again (with back-off) before giving up; 0 = one try.
    """
    import ray

    if ray.is_initialized():
        return False
    if address == "local":
        for key, value in _LOCAL_RAY_ENV.items():
            os.environ.setdefault(key, value)
        _local_ray_on_loopback()
        init_local_ray(num_cpus=os.cpu_count() or 1, log_to_driver=log_to_driver)
    else:

        def join() -> None:
            if ray.is_initialized():  # a failed try that left Ray half set up: start the next one clean
                ray.shutdown()
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=log_to_driver)

        retry_ray_join(join, address, join_timeout_s)
    return True


# Waits between tries to join a Ray cluster: the first, and the longest (doubling in between).
_JOIN_FIRST_WAIT_S = 2.0
_JOIN_MAX_WAIT_S = 30.0


def retry_ray_join(
    join: Callable[[], object],
    address: str,
    window_s: float,
    *,
    first_wait_s: float = _JOIN_FIRST_WAIT_S,
    max_wait_s: float = _JOIN_MAX_WAIT_S,
) -> None:
    """Call ``join`` until it returns, again after each connection failure while ``window_s``
    (from the first try) allows another; the last failure is raised once it does not.

    A Ray head that is still starting (a KubeRay head pod scheduled with the release, on a busy
    node) refuses or times out a client's connection though nothing is wrong; failing at once
    only turns that into container restarts and CrashLoopBackOff back-off. Anything other than
    a connection failure or timeout (a malformed address) is raised at once.
    """
    deadline = time.monotonic() + max(0.0, window_s)
    wait_s = first_wait_s
    tries = 0
    while True:
        tries += 1
        try:
            join()
            if tries > 1:
                logger.warning("joined the Ray cluster at %s after %d tries", address, tries)
            return
        except (ConnectionError, TimeoutError) as exc:
            left_s = deadline - time.monotonic()
            if left_s < wait_s:
                raise
            logger.warning(
                "cannot join the Ray cluster at %s yet (try %d: %s); trying again in %.0f s, for %.0f s more",
                address,
                tries,
                exc,
                wait_s,
                left_s,
            )
        time.sleep(wait_s)
        wait_s = min(wait_s * 2, max_wait_s)


def init_local_ray(*, num_cpus: int, log_to_driver: bool, object_store_bytes: int = _LOCAL_OBJECT_STORE_BYTES) -> None:
    """Start a new local Ray cluster, again when its raylet misses Ray's registration window.

    A failed start leaves the GCS and raylet it spawned running (Ray raises from inside its
    node constructor), so those children of this process are killed before the next try.
    """
    import ray

    for attempt in range(1, _LOCAL_START_ATTEMPTS + 1):
        before = _descendants()
        try:
            # address="local": always a new cluster, never one that happens to be
            # running on this machine (ray.init() without an address would join it).
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                object_store_memory=object_store_bytes,
                logging_level=logging.WARNING,
                log_to_driver=log_to_driver,
            )
            return
        except Exception as exc:
            if not any(text in str(exc) for text in _START_TIMEOUT_TEXTS) or attempt == _LOCAL_START_ATTEMPTS:
                raise
            logger.warning("local Ray did not start in time (attempt %d, host busy?); starting it again", attempt)
            ray.shutdown()
            stale = [pid for pid in _descendants() - before if _is_ray_process(pid)]
            for pid in stale:  # not, say, a compile worker another thread started meanwhile
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid in stale:  # reap our own children (no zombies); others are not ours to wait for
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)


def _is_ray_process(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"/ray/" in cmdline or cmdline.startswith(b"ray::")


def _descendants() -> set[int]:
    """Pids of this process's children, grandchildren, ... (from /proc; empty where there is none)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found: set[int] = set()
    todo = [os.getpid()]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _start_actor(config: OrchestratorConfig, *, name: str | None = None) -> Any:
    """One GpuWorker actor (not waited for); ``name``: a pooled worker, detached under that name."""
    from specmask.gpu_worker.actor import start_remote_worker

    # num_gpus=None: one GPU per worker when the Ray cluster has GPUs (asked of
    # the cluster, not of this process: the orchestrator may run on a CPU node).
    # max_task_retries=0: a step is never replayed on a restarted actor (its
    # sequences are gone); the engine fails that batch and re-admits the worker.
    # enable_task_events=False: every step/add/remove is a Ray task, ~100 a second per
    # worker, and each one's events were kept by the GCS (up to 100,000 tasks): its RSS
    # grew ~12 MB/min under bench.soak. Nothing reads them.
    pooled: dict[str, Any] = {}
    if name is not None:
        # Detached: it outlives this orchestrator's Ray job, for the next one to adopt.
        pooled = {"name": name, "namespace": RAY_NAMESPACE, "lifetime": "detached"}
    return start_remote_worker(
        config.worker_config(),
        num_gpus=config.worker_num_gpus,
        max_restarts=config.worker_max_restarts,
        max_task_retries=0,
        enable_task_events=False,
        **pooled,
    )


async def start_workers(config: OrchestratorConfig) -> list[WorkerSlot]:
    """Create ``num_workers`` GpuWorker actors and wait (bounded) until all have loaded."""
    actors = [_start_actor(config) for _ in range(config.num_workers)]
    try:
        infos: list[WorkerInfo] = await asyncio.wait_for(
            asyncio.gather(*(asyncio.wrap_future(a.info.remote().future()) for a in actors)),
            config.worker_start_timeout_s,
        )
    except BaseException as exc:
        stop_workers(actors)
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            raise _start_timeout(config.worker_start_timeout_s) from None
        raise
    first = infos[0]
    for i, info in enumerate(infos):
        if not info.serves_same_model(first):
            stop_workers(actors)
            raise RuntimeError(f"worker {i} loaded a different model than worker 0: {info} vs {first}")
        logger.info(
            "worker %d ready on %s: vocab %d, max_model_len %d", i, info.device, info.vocab_size, info.max_model_len
        )
    return [
        WorkerSlot(index=i, actor=actor, info=info, capacity=config.max_batch)
        for i, (actor, info) in enumerate(zip(actors, infos))
    ]


async def replace_worker(config: OrchestratorConfig, old: Any) -> tuple[Any, WorkerInfo]:
    """Kill a lost worker's actor (for good: Ray does not restart it) and start a new one;
    returns its handle and info once it has loaded (bounded by ``worker_start_timeout_s``).

    Killing first frees what the old process held (its GPU, its memory), which the new one
    may need; SIGKILL also ends a stopped (SIGSTOP) process."""
    import ray

    try:
        await asyncio.to_thread(ray.kill, old, no_restart=True)
    except Exception as exc:  # already gone
        logger.info("killing the lost worker actor: %r", exc)
    actor = _start_actor(config)
    try:
        info: WorkerInfo = await asyncio.wait_for(
            asyncio.wrap_future(actor.info.remote().future()), config.worker_start_timeout_s
        )
    except BaseException:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:
            logger.warning("could not kill the replacement that failed to start: %r", exc)
        raise
    return actor, info


def stop_workers(actors: list[Any]) -> None:
    """Ask workers to free sequences and close mask sessions (bounded), then kill them."""
    import ray

    if not actors:
        return
    refs = [actor.shutdown.remote() for actor in actors]
    _ready, pending = ray.wait(refs, num_returns=len(refs), timeout=_SHUTDOWN_TIMEOUT_S)
    if pending:
        logger.warning("%d worker(s) did not shut down within %.0f s; killing them", len(pending), _SHUTDOWN_TIMEOUT_S)
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception as exc:
            logger.warning("could not kill worker actor: %r", exc)


# ---- pooled workers: detached, leased, adopted by the next orchestrator -------------------------

WORKER_PREFIX = "specmask-worker-"
# A lease lapses this long after its holder's last renewal (renewed every third of it): how long
# the workers of an orchestrator that died without releasing them wait before another adopts them.
LEASE_TTL_S = 30.0
# A starting orchestrator polls this often for workers a draining one is about to release.
_HANDOVER_POLL_S = 1.0
# A starting orchestrator that finds the pool's workers all driven by others waits this long for
# one to be marked draining before it creates its own: the replaced orchestrator's SIGTERM and
# this one's start race (the registry may hear this one first).
HANDOVER_GRACE_S = 15.0
# A registry call is one actor method on a tiny table.
_REGISTRY_TIMEOUT_S = 30.0
# Ray frees a killed actor's name asynchronously; a replacement under the same name waits for it.
_NAME_FREE_WAIT_S = 60.0


def config_fingerprint(config: OrchestratorConfig) -> str:
    """A short hash of what a worker was built with (models, dtype, batch, KV budget, mask
    addresses, GPUs per actor; not its logging): a worker is adopted only by an orchestrator
    whose fingerprint is the same, so an upgrade that changes any of it never keeps serving the
    old models or flags."""
    import dataclasses
    import hashlib

    # Logging settings change no output: an adopted worker keeps logging as it was started.
    built = dataclasses.replace(config.worker_config(), log_level=None, log_format="text")
    text = repr((built, config.worker_num_gpus))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def worker_name(pool: str, fingerprint: str, index: int) -> str:
    return f"{WORKER_PREFIX}{pool}-{fingerprint}-{index}"


def parse_worker_name(pool: str, name: str) -> tuple[str, int] | None:
    """(fingerprint, index) of a pooled worker's actor name, or None when it is not this pool's."""
    prefix = f"{WORKER_PREFIX}{pool}-"
    if not name.startswith(prefix):
        return None
    fingerprint, _, index = name[len(prefix) :].rpartition("-")
    if len(fingerprint) != 12 or not index.isdigit():
        return None
    return fingerprint, int(index)


async def _ray_call(ref: Any, timeout_s: float) -> Any:
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)


class WorkerPool:
    """The orchestrator's GPU workers: ``start`` them, ``add`` and ``retire`` one at run time
    (orchestrator.worker_scaling), ``replace`` a lost one, ``close`` on shutdown.

    Owned (``config.worker_pool`` empty): the actors belong to this process's Ray job and are
    killed on close, as they always were. Pooled: detached named actors
    (``specmask-worker-<pool>-<fingerprint>-<i>`` in the ``specmask`` Ray namespace) leased
    through orchestrator.worker_leases; ``start`` adopts live ones built with the same
    configuration (reset: a previous driver's sequences are freed) and creates only the missing
    ones, and ``close`` frees their sequences and releases the leases without killing them, so
    the next orchestrator (a rolling update's new pod, a restart) serves at once, no model load.
    docs/deployment.md has the design and why."""

    def __init__(self, config: OrchestratorConfig, *, owner: str | None = None) -> None:
        self.config = config
        self.pool = config.worker_pool
        self.fingerprint = config_fingerprint(config)
        # Unique per orchestrator process (pod names repeat across restarts of a StatefulSet).
        self.owner = owner or f"{os.uname().nodename}-{os.getpid()}-{os.urandom(4).hex()}"
        self._names: dict[str, str] = {}  # actor id (hex) -> its pooled name
        self._registry: Any = None
        self._renewal: asyncio.Task | None = None
        self.adopted = 0  # workers taken over from a previous orchestrator by start()

    @property
    def pooled(self) -> bool:
        return bool(self.pool)

    def name_of(self, actor: Any) -> str | None:
        return self._names.get(_actor_id(actor))

    # -- start ----------------------------------------------------------------------------

    async def start(self) -> list[WorkerSlot]:
        """``config.num_workers`` loaded workers, adopted where possible; bounded by
        ``worker_start_timeout_s``."""
        if not self.pooled:
            return await start_workers(self.config)
        self._registry = registry(self.pool)
        self._renewal = asyncio.create_task(self._renew_forever(), name="worker-lease-renewal")
        want = self.config.num_workers
        deadline = time.monotonic() + self.config.worker_start_timeout_s
        handover_until = time.monotonic() + HANDOVER_GRACE_S
        said = ""
        adopted: list[tuple[Any, WorkerInfo]] = []
        try:
            while True:
                adopted += await self._adopt(want - len(adopted))
                if len(adopted) >= want or time.monotonic() >= deadline:
                    break
                # Workers an orchestrator is draining (a rolling update's old pod) are released
                # within its grace period: wait for them rather than load the models again. While
                # others drive every worker, give the one being replaced a moment to say so.
                views = await self._views()
                others = [v for v in views.values() if v.owner not in ("", self.owner)]
                if not any(v.draining for v in others) and (not others or time.monotonic() >= handover_until):
                    break
                why = (
                    "waiting for workers a draining orchestrator is about to release"
                    if any(v.draining for v in others)
                    else f"every worker is driven by another orchestrator: waiting up to {HANDOVER_GRACE_S:g} s "
                    "for one to be handed over"
                )
                if why != said:
                    logger.info(why)
                    said = why
                await asyncio.sleep(_HANDOVER_POLL_S)
            await self._sweep_stale()
            self.adopted = len(adopted)
            created = []
            for _ in range(want - len(adopted)):
                created.append(await self._create())
            infos = list(
                await asyncio.wait_for(
                    asyncio.gather(*(_ray_call(a.info.remote(), self.config.worker_start_timeout_s) for a in created)),
                    max(1.0, deadline - time.monotonic()),
                )
            )
        except BaseException as exc:
            await self._give_back([a for a, _ in adopted])
            await self._discard(self._names_to_actors())
            await self._stop_renewal()
            if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
                raise _start_timeout(self.config.worker_start_timeout_s) from None
            raise
        pairs = adopted + list(zip(created, infos))
        first = pairs[0][1]
        for _, info in pairs:
            if not info.serves_same_model(first):
                await self._discard([a for a, _ in pairs])
                await self._stop_renewal()
                raise RuntimeError(f"pooled workers serve different models: {info} vs {first}")
        logger.info(
            "worker pool %s: %d adopted, %d created (fingerprint %s)",
            self.pool,
            len(adopted),
            len(created),
            self.fingerprint,
        )
        return [
            WorkerSlot(index=i, actor=actor, info=info, capacity=self.config.max_batch)
            for i, (actor, info) in enumerate(pairs)
        ]

    def _names_to_actors(self) -> list[Any]:
        import ray

        actors = []
        for name in list(self._names.values()):
            with contextlib.suppress(Exception):
                actors.append(ray.get_actor(name, namespace=RAY_NAMESPACE))
        return actors

    def _fingerprint_of(self, name: str) -> str | None:
        parsed = parse_worker_name(self.pool, name)
        return parsed[0] if parsed is not None else None

    async def _views(self) -> dict[str, LeaseView]:
        views = await _ray_call(self._registry.snapshot.remote(), _REGISTRY_TIMEOUT_S)
        return {v.name: v for v in views}

    async def _pool_names(self) -> list[str]:
        """Names of this pool's live worker actors (any fingerprint)."""
        import ray

        listed = await asyncio.to_thread(ray.util.list_named_actors, True)
        names = [e["name"] for e in listed if e.get("namespace") == RAY_NAMESPACE]
        return sorted(n for n in names if parse_worker_name(self.pool, n) is not None)

    async def _adopt(self, need: int) -> list[tuple[Any, WorkerInfo]]:
        """Lease and take over up to ``need`` live workers with this fingerprint that no one drives."""
        import ray

        if need <= 0:
            return []
        views = await self._views()
        mine = [n for n in await self._pool_names() if self._fingerprint_of(n) == self.fingerprint]
        free = [n for n in mine if n not in views or views[n].owner in ("", self.owner)]
        free = [n for n in free if n not in self._names.values()]
        held = await _ray_call(self._registry.claim.remote(self.owner, free[:need], LEASE_TTL_S), _REGISTRY_TIMEOUT_S)
        adopted: list[tuple[Any, WorkerInfo]] = []
        for name in held:
            try:
                actor = ray.get_actor(name, namespace=RAY_NAMESPACE)
                info: WorkerInfo = await _ray_call(actor.info.remote(), self.config.step_timeout_s)
                freed = await _ray_call(actor.reset.remote(), self.config.step_timeout_s)
            except Exception as exc:  # dead, or not answering: not worth waiting for; free its GPU
                logger.warning("pooled worker %s does not answer (%s); killing it", name, exc)
                await self._kill_named(name)
                continue
            self._names[_actor_id(actor)] = name
            logger.info("adopted worker %s (pid %d, freed %d stale sequences)", name, info.pid, freed)
            adopted.append((actor, info))
        return adopted

    async def _sweep_stale(self) -> None:
        """Kill the pool's workers built with another configuration that no one drives (an
        upgrade changed the models or flags): their GPUs go to the new ones."""
        views = await self._views()
        stale = [
            n
            for n in await self._pool_names()
            if self._fingerprint_of(n) != self.fingerprint and (n not in views or views[n].owner in ("", self.owner))
        ]
        if not stale:
            return
        held = await _ray_call(self._registry.claim.remote(self.owner, stale, LEASE_TTL_S), _REGISTRY_TIMEOUT_S)
        for name in held:
            logger.warning("killing pooled worker %s: built with another configuration", name)
            await self._kill_named(name)

    async def _kill_named(self, name: str) -> None:
        import ray

        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.kill, ray.get_actor(name, namespace=RAY_NAMESPACE), no_restart=True)
        await _ray_call(self._registry.forget.remote(self.owner, [name]), _REGISTRY_TIMEOUT_S)
        self._names = {k: v for k, v in self._names.items() if v != name}

    async def _reserve_name(self) -> str:
        """Lease the lowest index no live worker or lease of this fingerprint uses."""
        views = await self._views()
        taken = {
            parsed[1]
            for n in [*await self._pool_names(), *views]
            if (parsed := parse_worker_name(self.pool, n)) is not None and parsed[0] == self.fingerprint
        }
        taken |= {i for n in self._names.values() if (p := parse_worker_name(self.pool, n)) for i in [p[1]]}
        index = 0
        while True:
            while index in taken:
                index += 1
            name = worker_name(self.pool, self.fingerprint, index)
            held = await _ray_call(self._registry.claim.remote(self.owner, [name], LEASE_TTL_S), _REGISTRY_TIMEOUT_S)
            if held:
                return name
            taken.add(index)  # another orchestrator reserved it meanwhile

    async def _create(self, name: str | None = None) -> Any:
        """A new detached worker under a reserved name (not waited for)."""
        name = name or await self._reserve_name()
        actor = _start_actor(self.config, name=name)
        self._names[_actor_id(actor)] = name
        return actor

    # -- run time ---------------------------------------------------------------------------

    async def add(self) -> tuple[Any, WorkerInfo]:
        """One more worker, loaded (bounded by ``worker_start_timeout_s``). On Kubernetes the
        new actor's GPU request is what makes KubeRay's autoscaler add a GPU pod when none is free."""
        actor = await self._create() if self.pooled else _start_actor(self.config)
        try:
            info: WorkerInfo = await _ray_call(actor.info.remote(), self.config.worker_start_timeout_s)
        except BaseException:
            await self.retire(actor)
            raise
        return actor, info

    async def retire(self, actor: Any) -> None:
        """A worker no longer wanted (its batch is empty): free it and kill it, GPU included."""
        await self._discard([actor])

    async def replace(self, old: Any) -> tuple[Any, WorkerInfo]:
        """A lost worker's replacement: the old actor killed, a new one under the same name."""
        if not self.pooled:
            return await replace_worker(self.config, old)
        import ray

        name = self._names.pop(_actor_id(old), None)
        try:
            await asyncio.to_thread(ray.kill, old, no_restart=True)
        except Exception as exc:  # already gone
            logger.info("killing the lost worker actor: %r", exc)
        if name is not None:
            deadline = time.monotonic() + _NAME_FREE_WAIT_S
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(name, namespace=RAY_NAMESPACE)
                except ValueError:
                    break
                await asyncio.sleep(0.2)
        actor = await self._create(name)
        try:
            info: WorkerInfo = await _ray_call(actor.info.remote(), self.config.worker_start_timeout_s)
        except BaseException:
            await self.retire(actor)
            raise
        return actor, info

    # -- leases -----------------------------------------------------------------------------

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(LEASE_TTL_S / 3)
            names = list(self._names.values())
            try:
                lost = await _ray_call(self._registry.renew.remote(self.owner, names, LEASE_TTL_S), _REGISTRY_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the registry restarting: the next renewal re-asserts
                logger.warning("renewing the worker leases failed: %s", exc)
                continue
            for name in lost:
                # Only after this process lost the registry for longer than a lease while still
                # reaching the worker (docs/deployment.md names it as a known limit).
                logger.error("worker %s is leased by another orchestrator now; no longer renewing it", name)
                self._names = {k: v for k, v in self._names.items() if v != name}

    async def mark_draining(self) -> None:
        """SIGTERM: say the leases are about to be released (a starting orchestrator waits for them)."""
        if self._registry is None:
            return
        try:
            await _ray_call(self._registry.drain.remote(self.owner), _REGISTRY_TIMEOUT_S)
        except Exception as exc:
            logger.warning("marking the worker leases draining failed: %s", exc)

    async def close(self, actors: list[Any]) -> None:
        """Shutdown: owned workers are stopped and killed; pooled ones have their sequences freed
        and their leases released, and live on for the next orchestrator."""
        await self._stop_renewal()
        if self.pooled:
            await self._give_back(actors)
        else:
            await self._discard(actors)

    async def _stop_renewal(self) -> None:
        if self._renewal is not None:
            self._renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewal
            self._renewal = None

    async def _discard(self, actors: list[Any]) -> None:
        """Stop and kill workers (GPU freed) and drop their names from the registry."""
        await asyncio.to_thread(stop_workers, actors)
        names = [n for a in actors if (n := self._names.pop(_actor_id(a), None)) is not None]
        if names and self._registry is not None:
            try:
                await _ray_call(self._registry.forget.remote(self.owner, names), _REGISTRY_TIMEOUT_S)
            except Exception as exc:  # a stale name is skipped by the next start (not listed by Ray)
                logger.warning("dropping killed workers from the lease registry failed: %s", exc)

    async def _give_back(self, actors: list[Any]) -> None:
        """Free pooled workers' sequences and release their leases; the actors live on."""
        resets = [_ray_call(a.reset.remote(), _SHUTDOWN_TIMEOUT_S) for a in actors]
        for actor, result in zip(actors, await asyncio.gather(*resets, return_exceptions=True)):
            if isinstance(result, BaseException):
                # Released unclean: the next orchestrator resets it on adoption anyway.
                logger.warning("freeing pooled worker %s failed: %r", self.name_of(actor), result)
        names = [n for a in actors if (n := self._names.pop(_actor_id(a), None)) is not None]
        if names and self._registry is not None:
            try:
                await _ray_call(self._registry.release.remote(self.owner, names), _REGISTRY_TIMEOUT_S)
            except Exception as exc:  # they are adoptable once the leases lapse
                logger.warning("releasing the worker leases failed (they lapse in %.0f s): %s", LEASE_TTL_S, exc)
            logger.info("released %d pooled workers for the next orchestrator", len(names))


def _actor_id(actor: Any) -> str:
    return actor._actor_id.hex()


def _start_timeout(timeout_s: float) -> RuntimeError:
    """The error for workers that did not start in time, naming the likeliest cause."""
    return RuntimeError(
        f"GPU workers did not start within {timeout_s:.0f} s "
        "(an actor asking for a GPU the cluster lacks waits forever; see --worker-num-gpus)"
    )
