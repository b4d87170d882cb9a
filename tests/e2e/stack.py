"""The real stack the end-to-end tests share, and helpers to inspect it.

Two mask-service replicas (subprocesses on 127.0.0.1), a local Ray with two
GPU-worker actors (CPU here), and the orchestrator on an asyncio loop in a
background thread; tests talk to it over gRPC like any client. Models: the
tiny random-init HF Llama pair (tests/fixtures/tiny_models.py), built in a
second. Everything is started once per session (start-up dominates: Ray plus
a torch import per worker process).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from specmask.orchestrator.client import OrchestratorClient, StreamedResult
from specmask.orchestrator.dev.local_stack import RunningStack, StackConfig, running_stack
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_DATA = REPO_ROOT / "tests" / "data" / "maskbench"
# Small on purpose: the overload test must be able to fill the queue.
MAX_BATCH = 16
MAX_QUEUE = 16
# A start that fails raises at once; this bound is for one that hangs. A saturated shared CI
# box can take minutes (Ray's raylet may need a second try, the actor imports torch).
STACK_START_TIMEOUT_S = 600.0
RAY_CALL_TIMEOUT_S = 60.0

# Bounded structures only (enums, booleans, fixed-size arrays): every output
# completes within its budget whatever the random-init model prefers.
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "mid", "high"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    },
    "required": ["ok", "level", "flags"],
    "additionalProperties": False,
}
_ITEM = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}},
    "required": ["ok", "level"],
    "additionalProperties": False,
}
# ~6 x 27 characters: completes in ~170 tokens (byte-level tokens on the tiny vocab).
LONG_SCHEMA = {"type": "array", "items": _ITEM, "minItems": 6, "maxItems": 6}
LONG_MAX_TOKENS = 256
# Cannot complete within the tiny model's context: runs until cancelled (or max_tokens).
ENDLESS_SCHEMA = {"type": "array", "items": _ITEM, "minItems": 40, "maxItems": 40}
ENDLESS_MAX_TOKENS = 450
PROMPT = "Generate JSON for schema user:\n"


def load_schema_records(directory: Path) -> list[tuple[str, dict[str, Any]]]:
    """(name, JSONSchemaBench record) for every *.json in ``directory``, sorted by name."""
    return [(p.stem, json.loads(p.read_text())) for p in sorted(directory.glob("*.json"))]


def stream_concurrently(
    address: str, requests: Sequence[pb.GenerateRequest], on_started: Callable[[], None] | None = None
) -> list[StreamedResult]:
    """Stream all ``requests`` at once, one client each. Once every one has its first
    token (all are mid-generation), call ``on_started`` (e.g. kill something); return
    the results in request order when all have finished."""
    n = len(requests)
    started = threading.Barrier(n + 1, timeout=120)
    results = [StreamedResult() for _ in range(n)]

    def run(i: int) -> None:
        first = True
        with OrchestratorClient(address) as client:
            for chunk in client.stream(requests[i], timeout_s=300):
                results[i].add(chunk)
                if first and chunk.token_ids:
                    first = False
                    started.wait()

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(run, i) for i in range(n)]
        started.wait()
        if on_started is not None:
            on_started()
        for f in futures:
            f.result(timeout=300)
    return results


class ThreadStack:
    """The stack of local_stack.running_stack, run on a loop in a daemon thread."""

    def __init__(self, config: StackConfig, **overrides: Any) -> None:
        self._config = config
        self._overrides = overrides
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stack-loop", daemon=True)
        self._stop: asyncio.Event | None = None
        self._done: Any = None
        self.running: RunningStack | None = None

    def start(self) -> ThreadStack:
        self._thread.start()
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            self._stop = asyncio.Event()
            try:
                async with running_stack(self._config, **self._overrides) as running:
                    self.running = running
                    ready.set()
                    await self._stop.wait()
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                raise

        self._done = asyncio.run_coroutine_threadsafe(main(), self._loop)
        if not ready.wait(STACK_START_TIMEOUT_S):
            raise TimeoutError("stack did not start in time")
        if failure:
            raise failure[0]
        return self

    def run(self, coro: Any, timeout_s: float = 120.0) -> Any:
        """Run a coroutine on the stack's loop (e.g. to inspect engine state)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._done.result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # -- introspection for tests ---------------------------------------------
    @property
    def address(self) -> str:
        assert self.running is not None
        return self.running.address

    @property
    def http_url(self) -> str:
        """The HTTP API's root, without /v1 (the stack was started with an http_port)."""
        assert self.running is not None and self.running.server.http_port, "this stack serves no HTTP API"
        return f"http://127.0.0.1:{self.running.server.http_port}"

    def worker_num_active(self) -> list[int]:
        import ray

        assert self.running is not None
        refs = [a.num_active.remote() for a in self.running.server.worker_actors]
        return ray.get(refs, timeout=RAY_CALL_TIMEOUT_S)

    def mask_session_count(self) -> int:
        """Open sessions summed over the live mask-service replicas."""
        from specmask.mask_service.client.mask_client import MaskServiceClient

        assert self.running is not None
        total = 0
        for proc in self.running.mask_services:
            if not proc.running:
                continue
            # Its own connection: the in-process orchestrator's router may hold this address's
            # shared one in reconnect backoff after a restart (see MaskServiceClient).
            client = MaskServiceClient(proc.address, deadline_s=10.0, own_connection=True)
            try:
                total += client.session_count()
            finally:
                client.close()
        return total

    def assert_replicas_serving(self) -> None:
        """Every mask-service replica is alive and SERVING; otherwise fail with its exit status and log."""
        from specmask.orchestrator.dev.local_stack import health_status

        assert self.running is not None
        for i, proc in enumerate(self.running.mask_services):
            status = health_status(proc.address, timeout_s=10.0) if proc.running else None
            assert status == 1, (
                f"mask-service replica {i} at {proc.address} is not serving (health {status}, "
                f"exit status {proc.returncode}); its log ends:\n{proc.log_tail()}"
            )

    def wait_idle(self, timeout_s: float = 30.0) -> tuple[list[int], int]:
        """Wait until no worker holds a sequence and no replica holds a session; return the last counts."""
        deadline = time.monotonic() + timeout_s
        while True:
            active, sessions = self.worker_num_active(), self.mask_session_count()
            if (not any(active) and sessions == 0) or time.monotonic() > deadline:
                return active, sessions
            time.sleep(0.2)
