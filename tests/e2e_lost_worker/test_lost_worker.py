"""A GPU worker that dies for good (no restarts left): the orchestrator fails its requests and
releases the mask sessions they held on every replica, instead of leaving them to the
service's idle TTL (10 minutes). Its own stack (one worker, max_restarts=0), started after
tests/e2e's stack and its Ray are gone."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from specmask.orchestrator.client import build_request
from specmask.orchestrator.dev.local_stack import StackConfig, health_status
from specmask.proto import health as health_names
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import (
    ENDLESS_MAX_TOKENS,
    ENDLESS_SCHEMA,
    MAX_BATCH,
    MAX_QUEUE,
    PROMPT,
    RAY_CALL_TIMEOUT_S,
    ThreadStack,
    stream_concurrently,
)

pytestmark = pytest.mark.slow
SERVING, NOT_SERVING = 1, 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadStack]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    target, draft = build_tiny_model_pair(tmp_path_factory.mktemp("lost-worker-tiny"))
    config = StackConfig(
        target_dir=str(target),
        draft_dir=str(draft),
        mask_replicas=2,
        num_workers=1,
        log_dir=str(tmp_path_factory.mktemp("lost-worker-logs")),
    )
    s = ThreadStack(
        config, max_batch=MAX_BATCH, max_queue=MAX_QUEUE, default_max_tokens=64, worker_max_restarts=0
    ).start()
    yield s
    s.stop()


def test_worker_lost_for_good_releases_its_mask_sessions(stack: ThreadStack) -> None:
    import ray

    assert stack.running is not None
    (actor,) = stack.running.server.worker_actors
    pid = ray.get(actor.info.remote(), timeout=RAY_CALL_TIMEOUT_S).pid
    sessions_while_running: list[int] = []

    def kill_worker() -> None:
        sessions_while_running.append(stack.mask_session_count())
        os.kill(pid, signal.SIGKILL)

    requests = [
        build_request(PROMPT, schema=ENDLESS_SCHEMA, temperature=1.0, seed=i, max_tokens=ENDLESS_MAX_TOKENS)
        for i in range(4)
    ]
    results = stream_concurrently(stack.address, requests, on_started=kill_worker)
    assert sessions_while_running == [4]  # one per request, spread over both replicas
    assert all(r.finish_reason == pb.FINISH_REASON_ERROR and "GPU worker 0" in r.error for r in results), [
        (r.finish_reason, r.error) for r in results
    ]
    deadline = time.monotonic() + 30
    while stack.mask_session_count():
        assert time.monotonic() < deadline, "the lost worker's mask sessions were not released"
        time.sleep(0.2)
    # No restart happened (none allowed) and none could have released them.
    assert stack.running.server.engine.worker_health() == [False]
    assert health_status(stack.address) == NOT_SERVING
    # Readiness is down, liveness is not: a kubelet takes the pod out of the Service
    # but does not restart it (specmask/proto/health.py).
    assert health_status(stack.address, service=health_names.LIVENESS) == SERVING
