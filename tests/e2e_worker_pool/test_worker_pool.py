"""Pooled GPU workers, for real (local Ray, CPU workers, the tiny model pair, real mask service):

* a rolling update of two orchestrator replicas while a client keeps streaming and sending
  requests through the "Service" (the replicas in it): 0 failed requests, and the new
  replicas adopt the old ones' workers (same processes: no model load);
* worker autoscaling: 1 -> 2 workers under a sustained load, back to 1 when idle, and no
  request lost across either change.

One Ray and one mask service for the module; the orchestrators run on the stack's loop, each
built by create_server as `specmask orchestrator` builds it, stopped as SIGTERM stops it.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.orchestrator.dev.local_stack import StackConfig
from specmask.orchestrator.worker_pool import _REGISTRY_TIMEOUT_S, _SHUTDOWN_TIMEOUT_S
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import BOUNDED_SCHEMA, LONG_MAX_TOKENS, LONG_SCHEMA, PROMPT, RAY_CALL_TIMEOUT_S, ThreadStack

pytestmark = pytest.mark.slow
POOL = "e2e-roll"
# Generous: a worker's model load (a Ray actor importing torch) on a busy two-core box.
WAIT_S = 600.0
_DONE = (pb.FINISH_REASON_GRAMMAR_COMPLETE, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadStack]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    target, draft = build_tiny_model_pair(tmp_path_factory.mktemp("pool-tiny"))
    config = StackConfig(
        target_dir=str(target),
        draft_dir=str(draft),
        mask_replicas=1,
        num_workers=1,
        log_dir=str(tmp_path_factory.mktemp("pool-logs")),
    )
    # Replica A of the pool; the test adds B, then rolls both.
    s = ThreadStack(config, max_batch=4, max_queue=64, worker_pool=POOL, shutdown_grace_s=WAIT_S).start()
    yield s
    s.stop()


class Replica:
    """One orchestrator on the stack's loop (create_server + start), stopped like SIGTERM does."""

    def __init__(self, stack: ThreadStack, **overrides: Any) -> None:
        from specmask.orchestrator.api.grpc_server import create_server

        assert stack.running is not None
        config = dataclasses.replace(stack.running.config, port=0, metrics_port=None, http_port=None, **overrides)

        async def start() -> tuple[Any, int]:
            server, port = await create_server(config)
            await server.start()
            return server, port

        self._stack = stack
        self.server, port = stack.run(start(), timeout_s=WAIT_S)
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> None:
        self._stack.run(self.server.stop(), timeout_s=WAIT_S)


def _pids(actors: list[Any]) -> set[int]:
    import ray

    return {info.pid for info in ray.get([a.info.remote() for a in actors], timeout=RAY_CALL_TIMEOUT_S)}


class Client:
    """Requests sent back to back on ``threads`` threads to the addresses in ``endpoints`` (what a
    Service's endpoints hold: ready replicas), every other one streamed; counts the outcomes."""

    def __init__(self, endpoints: list[str], threads: int, max_tokens: int = 48, schema: Any = BOUNDED_SCHEMA) -> None:
        self.endpoints = endpoints
        self.lock = threading.Lock()
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._max_tokens = max_tokens
        self._schema = schema
        self._counter = itertools.count()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def start(self) -> Client:
        for t in self._threads:
            t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            n = next(self._counter)
            with self.lock:
                address = self.endpoints[n % len(self.endpoints)]
            request = build_request(PROMPT, schema=self._schema, max_tokens=self._max_tokens, temperature=1.0, seed=n)
            try:
                with OrchestratorClient(address) as client:
                    if n % 2:
                        result = client.stream_all(request, timeout_s=WAIT_S)
                        reason, error, tokens = result.finish_reason, result.error, result.token_ids
                    else:
                        resp = client.generate(request, timeout_s=WAIT_S)
                        reason, error, tokens = resp.finish_reason, resp.error, list(resp.token_ids)
            except Exception as exc:  # a refused or cut call is a failed request
                with self.lock:
                    self.failures.append(f"{address}: {exc!r}")
                continue
            with self.lock:
                if reason in _DONE and not error and tokens:
                    self.ok += 1
                else:
                    self.failures.append(f"{address}: finish {reason} error {error!r}")

    def wait_for(self, ok: int, timeout_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ok < ok:
            assert not self.failures, self.failures
            assert time.monotonic() < deadline, f"only {self.ok} requests completed"
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in self._threads)


def _roll(client: Client, stop_old: Callable[[], None], address: str, replace: Callable[[], Replica]) -> Replica:
    """What a rolling update's step does to one replica: out of the endpoints, SIGTERM (drain,
    leases released), and its replacement started at once (it waits for the released workers)."""
    with client.lock:
        client.endpoints.remove(address)
    stopper = threading.Thread(target=stop_old)
    stopper.start()  # the replacement starts while the old one drains, as with maxSurge 0
    new = replace()
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    with client.lock:
        client.endpoints.append(new.address)
    return new


def test_a_rolling_update_drops_no_request_and_loads_no_model(stack: ThreadStack) -> None:
    assert stack.running is not None
    a = stack.running.server
    b = Replica(stack)  # the second replica: A drives the pool's only worker, so B creates one
    assert b.server.pool.adopted == 0
    pids_before = _pids(a.worker_actors) | _pids(b.server.worker_actors)
    assert len(pids_before) == 2
    client = Client([stack.address, b.address], threads=3).start()
    try:
        client.wait_for(4)

        a2 = _roll(client, lambda: stack.run(a.stop(), timeout_s=WAIT_S), stack.address, lambda: Replica(stack))
        done = client.ok
        client.wait_for(done + 4)
        b2 = _roll(client, b.stop, b.address, lambda: Replica(stack))
        done = client.ok
        client.wait_for(done + 4)
    finally:
        client.stop()
    assert not client.failures, client.failures
    # Each new replica adopted its predecessor's worker: the same processes, no model loaded.
    assert a2.server.pool.adopted == 1 and b2.server.pool.adopted == 1
    assert _pids(a2.server.worker_actors) | _pids(b2.server.worker_actors) == pids_before
    b2.stop()
    a2.stop()


def _kill_pool(pool: str) -> None:
    """Kill a pool's detached workers: each holds one of this local Ray's two CPUs (Ray's default
    for an actor), which the next test's workers need."""
    import ray

    from specmask.orchestrator.worker_leases import RAY_NAMESPACE
    from specmask.orchestrator.worker_pool import parse_worker_name

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == RAY_NAMESPACE and parse_worker_name(pool, entry["name"]) is not None:
            ray.kill(ray.get_actor(entry["name"], namespace=RAY_NAMESPACE), no_restart=True)


def test_workers_follow_the_load_up_and_back_down(stack: ThreadStack) -> None:
    assert stack.running is not None
    stack.run(stack.running.server.stop(), timeout_s=WAIT_S)  # a no-op when the rolling test stopped it
    _kill_pool(POOL)
    replica = Replica(
        stack,
        worker_pool="e2e-scale",
        num_workers=1,
        min_workers=1,
        max_workers=2,
        scale_up_queue_wait_s=0.3,
        scale_up_after_s=2.0,
        scale_down_idle_s=5.0,
        max_batch=2,
    )
    server = replica.server
    assert server.scaler is not None
    # Eight clients, each sending ~170-token requests back to back, on a batch of two: six wait.
    client = Client([replica.address], threads=8, max_tokens=LONG_MAX_TOKENS, schema=LONG_SCHEMA).start()
    try:
        deadline = time.monotonic() + WAIT_S
        while len(server.worker_actors) < 2:
            assert not client.failures, client.failures
            assert time.monotonic() < deadline, "no worker was added under a sustained load"
            time.sleep(0.2)
        done = client.ok
        client.wait_for(done + 6)  # served with two workers
    finally:
        client.stop()
    assert not client.failures, client.failures
    assert server.scaler.added == 1
    # The load has stopped (every client thread joined, its last request answered). Scale-in is
    # due once the policy's cooldown after the scale-up and its idle period have passed; then the
    # retired worker finishes its (empty) batch, is shut down and killed, and its name dropped from
    # the lease registry, each bounded. The deadline allows all that several times over, for a
    # busy box; what is waited for is the change completing (the worker can leave the engine's
    # placement before its actor is killed and the scaler counts it).
    scaler = server.scaler
    policy = scaler.policy
    scale_in_s = 4 * (policy.cooldown_s + policy.scale_down_idle_s + scaler.tick_s) + 2 * (
        _SHUTDOWN_TIMEOUT_S + _REGISTRY_TIMEOUT_S
    )
    deadline = time.monotonic() + scale_in_s
    while scaler.retired < 1 or scaler.busy:
        assert scaler.failed == 0
        assert time.monotonic() < deadline, (
            f"the idle pool did not go back to one worker within {scale_in_s:.0f} s: "
            f"{len(server.worker_actors)} workers, retired {scaler.retired}, busy {scaler.busy}, "
            f"live requests {server.engine.num_live()}, load {scaler.sample(time.monotonic())}"
        )
        time.sleep(0.2)
    assert len(server.worker_actors) == 1
    assert scaler.retired == 1 and scaler.added == 1 and scaler.failed == 0
    assert server.engine.num_live() == 0
    # Still serving, on the one worker left.
    with OrchestratorClient(replica.address) as c:
        resp = c.generate(build_request(PROMPT, schema=BOUNDED_SCHEMA, max_tokens=48), timeout_s=WAIT_S)
    assert resp.finish_reason in _DONE and not resp.error
    replica.stop()
