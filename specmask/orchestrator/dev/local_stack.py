"""The whole stack on one machine: mask-service subprocess(es) + local Ray + orchestrator.

Used by `specmask up`, `specmask demo`, the end-to-end benchmark and the
end-to-end tests, so all four run the same processes the same way. Mask
services are real subprocesses (their failure is a process dying); the
orchestrator runs on the caller's event loop, with a local Ray whose worker
actors are Ray's own processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmask.common.parent_watch import PARENT_PID_ENV
from specmask.orchestrator.config import OrchestratorConfig
from specmask.orchestrator.dev.replica_supervisor import ReplicaSupervisor

if TYPE_CHECKING:
    from specmask.orchestrator.api.grpc_server import OrchestratorServer

logger = logging.getLogger(__name__)

# A mask service loads its tokenizer(s) and xgrammar at start: seconds on an idle host, but a
# saturated shared one can stretch its imports past a minute. The wait ends at once when the
# process exits, so the bound only matters for a start that hangs.
MASK_SERVICE_START_TIMEOUT_S = 180.0
# SIGTERM first (graceful: the service drains in-flight RPCs), SIGKILL after this.
STOP_TIMEOUT_S = 10.0


# The local stack's one interface: nothing it starts listens beyond this machine.
LOOPBACK = "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the kernel's pick); used for child processes we must name a port for."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def health_status(address: str, *, service: str = "", timeout_s: float = 5.0) -> int | None:
    """The standard gRPC health status of ``service`` at ``address``; None if unreachable."""
    # A channel of its own: a probe reports the server as it is now, never the
    # reconnect backoff of another channel to the same address in this process.
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return None
    return int(resp.status)


def wait_serving(address: str, timeout_s: float, *, process: subprocess.Popen | None = None) -> None:
    """Block until ``address`` reports SERVING; fail early if ``process`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process for {address} exited with code {process.returncode} before serving")
        if health_status(address, timeout_s=1.0) == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{address} was not SERVING within {timeout_s:.0f} s")


# Ports tried for a replica whose port we picked (see MaskServiceProcess).
_PORT_ATTEMPTS = 3


class MaskServiceProcess:
    """One `specmask mask-service` subprocess on 127.0.0.1."""

    def __init__(
        self,
        tokenizer_dirs: Sequence[str],
        *,
        port: int | None = None,
        log_path: str | Path | None = None,
        extra_args: Sequence[str] = (),
        metrics_port: int | None = None,
    ) -> None:
        """``metrics_port``: serve the replica's Prometheus /metrics there (None = off)."""
        self.port = port or free_port()
        self.metrics_port = metrics_port
        self.address = f"127.0.0.1:{self.port}"
        self._tokenizer_dirs = tuple(tokenizer_dirs)
        self._log_path = Path(log_path) if log_path is not None else None
        self._extra_args = tuple(extra_args)
        self.process: subprocess.Popen | None = None
        # A port we picked can be taken by someone else before the child binds it
        # (Ray starts beside it and binds many): until the first start has served,
        # such a port may be swapped for a fresh one. A given port, or a restart, is kept.
        self._may_repick = port is None
        self._served = False
        self._stopped_on_purpose = False

    def start(self, *, wait: bool = True) -> MaskServiceProcess:
        self._spawn()
        if wait:
            self.wait_serving()
        return self

    def _spawn(self) -> None:
        self._stopped_on_purpose = False
        cmd = [sys.executable, "-m", "specmask.orchestrator.cli", "mask-service"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        for tok in self._tokenizer_dirs:
            cmd += ["--tokenizer", tok]
        cmd += list(self._extra_args)
        if self.metrics_port is not None:
            cmd += ["--metrics-port", str(self.metrics_port)]
        out = open(self._log_path, "ab") if self._log_path is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            # No preexec_fn: no Python may run between fork and exec here (see
            # mask_service.parent_watch). The child arranges to die with us itself;
            # its own process group keeps a terminal's Ctrl-C away from it, so the
            # parent decides when it stops.
            self.process = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, PARENT_PID_ENV: str(os.getpid())},
                process_group=0,
            )
        finally:
            if not isinstance(out, int):  # not subprocess.DEVNULL
                out.close()
        logger.info("mask service starting on %s (pid %d)", self.address, self.process.pid)

    def wait_serving(self, timeout_s: float = MASK_SERVICE_START_TIMEOUT_S) -> None:
        for attempt in range(_PORT_ATTEMPTS):
            try:
                wait_serving(self.address, timeout_s, process=self.process)
                self._served = True
                return
            except RuntimeError as exc:  # exited before serving
                if not self._may_repick or self._served or attempt + 1 == _PORT_ATTEMPTS:
                    self.stop()
                    raise
                logger.warning("mask service on %s did not start (%s); trying another port", self.address, exc)
                self.port = free_port()
                self.address = f"127.0.0.1:{self.port}"
                self._spawn()
            except BaseException:
                self.stop()
                raise

    def kill(self) -> None:
        """SIGKILL: the abrupt failure a replica can suffer (tests)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        self._stopped_on_purpose = True  # a supervisor leaves it down
        p = self.process
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("mask service pid %d ignored SIGTERM; killing it", p.pid)
            p.kill()
            p.wait(STOP_TIMEOUT_S)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def stopped_on_purpose(self) -> bool:
        """Stopped by stop() (not crashed or killed): replica_supervisor leaves it down."""
        return self._stopped_on_purpose

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has ended (negative: killed by that signal)."""
        return None if self.process is None else self.process.poll()

    def log_tail(self, max_bytes: int = 4000) -> str:
        """The end of this replica's log file ('' when its output is discarded)."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        with open(self._log_path, "rb") as f:
            f.seek(max(0, self._log_path.stat().st_size - max_bytes))
            return f.read().decode(errors="replace")


@dataclass(frozen=True)
class StackConfig:
    """What `up`, `demo` and the benchmark vary; the rest is OrchestratorConfig's defaults."""

    target_dir: str
    draft_dir: str | None
    mask_replicas: int = 1
    port: int = 0
    metrics_port: int | None = None
    num_workers: int = 1
    log_dir: str | None = None  # mask-service logs; None = discarded
    worker_logs: bool = True  # False: Ray worker output stays out of this terminal (demo)
    restart_replicas: bool = False  # restart crashed mask replicas (`specmask up`); tests kill them on purpose
    mask_args: tuple[str, ...] = ()  # extra `specmask mask-service` flags (bench.soak: compile limits)
    mask_metrics: bool = False  # each replica serves /metrics on a free port (MaskServiceProcess.metrics_port)

    def orchestrator_config(self, mask_addresses: Sequence[str], **overrides: object) -> OrchestratorConfig:
        base = OrchestratorConfig(
            target_dir=self.target_dir,
            draft_dir=self.draft_dir,
            mask_service_addresses=tuple(mask_addresses),
            port=self.port,
            metrics_port=self.metrics_port,
            num_workers=self.num_workers,
            # Workers log at this process's level: `specmask up` (INFO) shows their
            # per-request lines, a bench or a test at WARNING is not flooded by them.
            worker_log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        )
        return replace(base, **overrides)  # type: ignore[arg-type]  # replace() checks the field names


def start_mask_services(config: StackConfig) -> list[MaskServiceProcess]:
    """Start ``mask_replicas`` services in parallel and wait until all serve."""
    log_dir = Path(config.log_dir) if config.log_dir else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    procs = [
        MaskServiceProcess(
            [config.target_dir],
            log_path=log_dir / f"mask-service-{i}.log" if log_dir is not None else None,
            extra_args=config.mask_args,
            metrics_port=free_port() if config.mask_metrics else None,
        ).start(wait=False)
        for i in range(config.mask_replicas)
    ]
    try:
        for p in procs:
            p.wait_serving()
    except BaseException:
        stop_all(procs)
        raise
    return procs


def stop_all(procs: Sequence[MaskServiceProcess]) -> None:
    for p in procs:
        p.stop()


def ensure_toy_models(out_dir: str | Path | None = None, *, progress: bool = True) -> tuple[str, str]:
    """The toy target/draft pair, trained on first use and cached (gpu_worker.toy.build)."""
    from specmask.gpu_worker.toy.build import DEFAULT_OUT_DIR, build_toy_models

    result = build_toy_models(DEFAULT_OUT_DIR if out_dir is None else out_dir, progress=progress)
    return str(result.target_dir), str(result.draft_dir)


@dataclass
class RunningStack:
    server: OrchestratorServer
    port: int
    mask_services: list[MaskServiceProcess]
    config: OrchestratorConfig

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def running_stack(stack: StackConfig, **overrides: object) -> AsyncIterator[RunningStack]:
    """Mask services + (local) Ray + orchestrator on this loop; everything stopped on exit.

    Ray is shut down on exit only if this call started it.
    """
    from specmask.orchestrator.api.grpc_server import create_server
    from specmask.orchestrator.worker_pool import connect_ray

    procs = await asyncio.to_thread(start_mask_services, stack)
    server = None
    supervisor: ReplicaSupervisor | None = None
    started_ray = False
    try:
        config = stack.orchestrator_config([p.address for p in procs], **overrides)
        started_ray = connect_ray(config.ray_address, log_to_driver=stack.worker_logs)
        server, port = await create_server(config)
        await server.start()
        if stack.restart_replicas:
            supervisor = ReplicaSupervisor(procs)
            supervisor.start()
        yield RunningStack(server=server, port=port, mask_services=procs, config=config)
    finally:
        if supervisor is not None:
            await supervisor.stop()
        if server is not None:
            await server.stop()
        await asyncio.to_thread(stop_all, procs)
        if started_ray:
            import ray

            ray.shutdown()
