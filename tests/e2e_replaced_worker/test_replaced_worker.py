"""A GPU worker whose actor is killed for good (ray.kill: Ray does not restart it), or whose process
stops (SIGSTOP: no heartbeat, no progress), while requests wait for it: the orchestrator starts a
replacement actor, the requests that had emitted nothing (queued, or placed and not yet streaming)
wait for it and complete, those that were streaming end with an error that says they were cut
off, and a request sent during the recovery waits instead of being refused. Its own stack (one
worker, a batch of two), started after the other e2e stacks and their Ray are gone."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from specmask.orchestrator.client import OrchestratorClient, StreamedResult, build_request
from specmask.orchestrator.dev.local_stack import StackConfig, health_status
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import BOUNDED_SCHEMA, ENDLESS_MAX_TOKENS, ENDLESS_SCHEMA, PROMPT, RAY_CALL_TIMEOUT_S, ThreadStack

pytestmark = pytest.mark.slow
SERVING = 1
BATCH = 2
QUEUED = 4
# Generous: a replacement loads the models on a busy two-core box.
WAIT_S = 600.0
# The liveness limit: a stopped worker is taken out after it, and replaced one more limit later.
LIVENESS_S = 10.0
_DONE = (pb.FINISH_REASON_GRAMMAR_COMPLETE, pb.FINISH_REASON_LENGTH)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadStack]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    target, draft = build_tiny_model_pair(tmp_path_factory.mktemp("replaced-worker-tiny"))
    config = StackConfig(
        target_dir=str(target),
        draft_dir=str(draft),
        mask_replicas=1,
        num_workers=1,
        log_dir=str(tmp_path_factory.mktemp("replaced-worker-logs")),
    )
    s = ThreadStack(
        config,
        max_batch=BATCH,
        max_queue=16,
        default_max_tokens=64,
        worker_recovery_wait_s=WAIT_S,
        step_timeout_s=LIVENESS_S,
    ).start()
    yield s
    s.stop()


def _metric(stack: ThreadStack, name: str, **labels: str) -> float:
    assert stack.running is not None
    return stack.running.server.metrics.registry.get_sample_value(name, labels) or 0.0


class _Streams:
    """Each request streamed on a thread of its own; ``first`` counts those that got a token."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.results: list[StreamedResult] = []
        self.threads: list[threading.Thread] = []
        self.first = threading.Semaphore(0)

    def start(self, request: pb.GenerateRequest) -> StreamedResult:
        result = StreamedResult()
        self.results.append(result)

        def run() -> None:
            seen = False
            try:
                with OrchestratorClient(self.address) as client:
                    for chunk in client.stream(request, timeout_s=WAIT_S):
                        result.add(chunk)
                        if chunk.token_ids and not seen:
                            seen = True
                            self.first.release()
            except Exception as exc:  # a refused call is a failure the test reports
                result.error = repr(exc)

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)
        return result

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=WAIT_S)
        assert not any(t.is_alive() for t in self.threads), "a stream never ended"


def _lose_the_worker_under_load(stack: ThreadStack, lose: Callable[[Any, int], None]) -> None:
    """Two streams in the batch, more requests queued behind them; ``lose(actor, pid)`` takes the
    worker down; a request sent while it is out. Checks what each got and that a new actor serves."""
    import ray

    assert stack.running is not None
    server = stack.running.server
    (old,) = server.worker_actors
    old_pid = ray.get(old.info.remote(), timeout=RAY_CALL_TIMEOUT_S).pid
    restarts_before = _metric(stack, "specmask_worker_restarts_total", worker="0")
    streams = _Streams(stack.address)
    # Two streams fill the batch and are mid-generation when the worker is lost...
    streaming = [
        streams.start(
            build_request(PROMPT, schema=ENDLESS_SCHEMA, temperature=1.0, seed=i, max_tokens=ENDLESS_MAX_TOKENS)
        )
        for i in range(BATCH)
    ]
    for _ in range(BATCH):
        assert streams.first.acquire(timeout=120), "the streams never started"
    # ...while more requests wait in the queue behind them.
    queued = [streams.start(build_request(PROMPT, schema=BOUNDED_SCHEMA, max_tokens=64)) for _ in range(QUEUED)]
    deadline = time.monotonic() + 60
    while server.engine.queue_depth < QUEUED:
        assert time.monotonic() < deadline, "the requests never queued"
        time.sleep(0.02)
    lose(old, old_pid)
    deadline = time.monotonic() + 120
    while server.engine.worker_health()[0]:
        assert time.monotonic() < deadline, "the lost worker was never taken out"
        time.sleep(0.05)
    # Sent while no worker is healthy: it waits for the replacement instead of UNAVAILABLE.
    late = streams.start(build_request(PROMPT, schema=BOUNDED_SCHEMA, max_tokens=64))
    streams.join()

    for r in streaming:
        # Mid-generation when the worker was lost (unless it had already finished): cut off, and said so.
        if r.finish_reason == pb.FINISH_REASON_ERROR:
            assert r.token_ids and "GPU worker 0" in r.error and "cut off" in r.error, r.error
    assert any(r.finish_reason == pb.FINISH_REASON_ERROR for r in streaming)
    for r in [*queued, late]:
        # Finished normally (complete, or at max_tokens), never failed.
        assert not r.error and r.finish_reason in _DONE, (r.finish_reason, r.error)
        assert r.token_ids
    # The slot holds a new actor, in a new process, back in placement and readiness.
    assert server.engine.worker_health() == [True]
    (new,) = server.worker_actors
    assert new is not old
    assert ray.get(new.info.remote(), timeout=RAY_CALL_TIMEOUT_S).pid != old_pid
    assert _metric(stack, "specmask_worker_restarts_total", worker="0") == restarts_before + 1
    deadline = time.monotonic() + 30
    while health_status(stack.address) != SERVING:
        assert time.monotonic() < deadline, "readiness did not come back with the replacement"
        time.sleep(0.2)


def test_a_killed_worker_is_replaced_and_its_waiting_requests_complete(stack: ThreadStack) -> None:
    import ray

    _lose_the_worker_under_load(stack, lambda actor, _pid: ray.kill(actor))


def test_a_stopped_worker_is_replaced_and_its_waiting_requests_complete(stack: ThreadStack) -> None:
    stopped: list[int] = []

    def stop(_actor: Any, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    try:
        _lose_the_worker_under_load(stack, stop)
    finally:
        for pid in stopped:  # replaced, it was SIGKILLed; if not, let it go on
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
