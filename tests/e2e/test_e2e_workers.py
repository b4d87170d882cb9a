"""A GPU worker process dies mid-generation: only its requests fail, the others complete, Ray
restarts the actor, the new process releases the mask sessions the dead one left open, and the
orchestrator puts it back into placement."""

from __future__ import annotations

import json
import os
import signal
import time

import jsonschema
import pytest

from specmask.orchestrator.client import build_request
from specmask.orchestrator.dev.local_stack import health_status
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import (
    ENDLESS_MAX_TOKENS,
    ENDLESS_SCHEMA,
    LONG_MAX_TOKENS,
    LONG_SCHEMA,
    PROMPT,
    RAY_CALL_TIMEOUT_S,
    ThreadStack,
    stream_concurrently,
)

pytestmark = pytest.mark.slow
SERVING = 1
RECOVERY_TIMEOUT_S = 120.0


def _worker_pids(stack: ThreadStack) -> list[int]:
    import ray

    assert stack.running is not None
    refs = [a.info.remote() for a in stack.running.server.worker_actors]
    return [info.pid for info in ray.get(refs, timeout=RAY_CALL_TIMEOUT_S)]


def _worker_0_count(stack: ThreadStack, name: str) -> float:
    """specmask_worker_{name}_total for worker 0 (0 before the first), as the other e2e tests read counters."""
    assert stack.running is not None
    registry = stack.running.server.metrics.registry
    return registry.get_sample_value(f"specmask_worker_{name}_total", {"worker": "0"}) or 0.0


def _run_all(stack: ThreadStack, n: int, seed: int, schema: dict, max_tokens: int, on_started=None):
    requests = [
        build_request(PROMPT, schema=schema, temperature=1.0, seed=seed + i, max_tokens=max_tokens) for i in range(n)
    ]
    return stream_concurrently(stack.address, requests, on_started)


def test_worker_killed_mid_generation_recovers(stack: ThreadStack) -> None:
    assert stack.running is not None
    engine = stack.running.server.engine
    assert stack.wait_idle() == ([0, 0], 0)
    pids = _worker_pids(stack)
    # The stack is shared by the module's tests, which may have failed and recovered a worker too.
    before = {name: _worker_0_count(stack, name) for name in ("failures", "recoveries")}
    # Requests that cannot complete (ENDLESS_SCHEMA runs to max_tokens): whatever the
    # timing, all four are still running when the barrier opens, two on each worker
    # (least-loaded placement); then worker 0's process dies.
    busy: list[int] = []

    def kill_worker_0() -> None:
        busy[:] = stack.worker_num_active()
        os.kill(pids[0], signal.SIGKILL)

    results = _run_all(stack, 4, 300, ENDLESS_SCHEMA, ENDLESS_MAX_TOKENS, on_started=kill_worker_0)
    assert busy == [2, 2], busy
    reasons = sorted(r.finish_reason for r in results)
    assert reasons == sorted([pb.FINISH_REASON_LENGTH] * 2 + [pb.FINISH_REASON_ERROR] * 2), [
        (r.finish_reason, r.error) for r in results
    ]
    for r in results:
        if r.finish_reason == pb.FINISH_REASON_ERROR:
            assert "GPU worker 0" in r.error, r.error
    assert health_status(stack.address, timeout_s=10) == SERVING  # worker 1 kept serving throughout

    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while engine.worker_health() != [True, True]:
        assert time.monotonic() < deadline, "worker 0 was not put back into placement"
        time.sleep(0.5)
    new_pids = _worker_pids(stack)
    assert new_pids[0] != pids[0] and new_pids[1] == pids[1]
    for name, count in before.items():
        assert _worker_0_count(stack, name) == count + 1, name
    # The dead process's mask sessions were released by its successor (same owner),
    # not left to the service's 10-minute idle TTL.
    assert stack.wait_idle() == ([0, 0], 0)

    # Both workers take requests again.
    results = _run_all(
        stack,
        4,
        400,
        ENDLESS_SCHEMA,
        ENDLESS_MAX_TOKENS,
        on_started=lambda: busy.__setitem__(slice(None), stack.worker_num_active()),
    )
    assert busy == [2, 2], busy
    assert all(r.finish_reason == pb.FINISH_REASON_LENGTH for r in results), [
        (r.finish_reason, r.error) for r in results
    ]
    # And what they produce is valid.
    for r in _run_all(stack, 2, 500, LONG_SCHEMA, LONG_MAX_TOKENS):
        assert r.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE, (r.finish_reason, r.error)
        jsonschema.validate(json.loads(r.text), LONG_SCHEMA)
    assert stack.wait_idle() == ([0, 0], 0)
