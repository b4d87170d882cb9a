"""A GPU worker process dies mid-generation: only its requests fail, the others complete, Ray
restarts the actor, the new process releases the mask sessions the dead one left open, and the
orchestrator puts it back into placement."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from orchestrator.client import OrchestratorClient, StreamedResult, build_request
from orchestrator.local_stack import health_status
from proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import LONG_MAX_TOKENS, LONG_SCHEMA, PROMPT, RAY_CALL_TIMEOUT_S, ThreadStack

pytestmark = pytest.mark.slow
SERVING = 1
RECOVERY_TIMEOUT_S = 120.0


def _worker_pids(stack: ThreadStack) -> list[int]:
    import ray

    assert stack.running is not None
    refs = [a.info.remote() for a in stack.running.server.worker_actors]
    return [info.pid for info in ray.get(refs, timeout=RAY_CALL_TIMEOUT_S)]


def _run_all(stack: ThreadStack, n: int, seed: int, on_started=None) -> list[StreamedResult]:  # type: ignore[no-untyped-def]
    started = threading.Barrier(n + 1, timeout=120)
    results = [StreamedResult() for _ in range(n)]

    def run(i: int) -> None:
        req = build_request(PROMPT, schema=LONG_SCHEMA, temperature=1.0, seed=seed + i, max_tokens=LONG_MAX_TOKENS)
        first = True
        with OrchestratorClient(stack.address) as client:
            for chunk in client.stream(req, timeout_s=300):
                results[i].add(chunk)
                if first and chunk.token_ids:
                    first = False
                    started.wait()

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(run, i) for i in range(n)]
        started.wait()  # every request is mid-generation
        if on_started is not None:
            on_started()
        for f in futures:
            f.result(timeout=300)
    return results


def test_worker_killed_mid_generation_recovers(stack: ThreadStack) -> None:
    assert stack.running is not None
    engine = stack.running.server.engine
    stack.wait_idle()
    pids = _worker_pids(stack)
    # Four requests over two workers (least-loaded placement: two each); worker 0 dies.
    results = _run_all(stack, 4, seed=300, on_started=lambda: os.kill(pids[0], signal.SIGKILL))
    failed = [r for r in results if r.finish_reason == pb.FINISH_REASON_ERROR]
    done = [r for r in results if r.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE]
    assert len(failed) + len(done) == 4, [(r.finish_reason, r.error) for r in results]
    assert failed and done, [(r.finish_reason, r.error) for r in results]
    assert all("GPU worker 0" in r.error for r in failed), [r.error for r in failed]
    for r in done:
        jsonschema.validate(json.loads(r.text), LONG_SCHEMA)
    assert health_status(stack.address) == SERVING  # worker 1 kept serving throughout

    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while engine.worker_health() != [True, True]:
        assert time.monotonic() < deadline, "worker 0 was not put back into placement"
        time.sleep(0.5)
    new_pids = _worker_pids(stack)
    assert new_pids[0] != pids[0] and new_pids[1] == pids[1]
    # The dead process's mask sessions were released by its successor (same owner),
    # not left to the service's 10-minute idle TTL.
    assert stack.wait_idle() == ([0, 0], 0)
    # Both workers take requests again, and all of them complete.
    seen_busy = [False, False]

    def watch() -> None:
        seen_busy[:] = [n > 0 for n in stack.worker_num_active()]

    results = _run_all(stack, 4, seed=400, on_started=watch)
    assert seen_busy == [True, True]
    for r in results:
        assert r.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE, (r.finish_reason, r.error)
        jsonschema.validate(json.loads(r.text), LONG_SCHEMA)
    assert stack.wait_idle() == ([0, 0], 0)
