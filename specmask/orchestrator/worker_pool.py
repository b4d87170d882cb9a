"""Ray connection and GPU worker actors: start them, wait for them, stop them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import Any

from specmask.gpu_worker.types import WorkerInfo
from specmask.orchestrator.config import OrchestratorConfig
from specmask.orchestrator.engine import WorkerSlot

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


def connect_ray(address: str, *, log_to_driver: bool = True) -> bool:
    """Join Ray; ``"local"`` starts an in-process cluster. Returns True if this call started Ray.

    Call it from the main thread: Ray installs its signal handlers there.
    ``log_to_driver=False`` keeps worker output out of this process's terminal.
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
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=log_to_driver)
    return True


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


def _start_actor(config: OrchestratorConfig) -> Any:
    """One GpuWorker actor (not waited for)."""
    from specmask.gpu_worker.actor import start_remote_worker

    # num_gpus=None: one GPU per worker when the Ray cluster has GPUs (asked of
    # the cluster, not of this process: the orchestrator may run on a CPU node).
    # max_task_retries=0: a step is never replayed on a restarted actor (its
    # sequences are gone); the engine fails that batch and re-admits the worker.
    # enable_task_events=False: every step/add/remove is a Ray task, ~100 a second per
    # worker, and each one's events were kept by the GCS (up to 100,000 tasks): its RSS
    # grew ~12 MB/min under bench.soak. Nothing reads them.
    return start_remote_worker(
        config.worker_config(),
        num_gpus=config.worker_num_gpus,
        max_restarts=config.worker_max_restarts,
        max_task_retries=0,
        enable_task_events=False,
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
            raise RuntimeError(
                f"GPU workers did not start within {config.worker_start_timeout_s:.0f} s "
                "(an actor asking for a GPU the cluster lacks waits forever; see --worker-num-gpus)"
            ) from None
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
