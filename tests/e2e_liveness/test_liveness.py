"""Long prompts under a short liveness limit, and a worker that truly stops.

Its own stack (two workers on a tiny pair with a 4k context, a small iteration budget and a
one-second liveness limit), started after the other e2e stacks and their Ray are gone.

* A burst of long prompts lands while a stream runs: the workers prefill them in chunks within
  the iteration budget, nobody is declared dead, every request succeeds, and the stream keeps
  emitting while the burst is prefilled.
* A worker is SIGSTOPped under a burst: its heartbeat stops answering, it is taken out, the
  requests it held that had generated nothing are queued again and finish on the other worker,
  and those already streaming end with an error that says they were cut off.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from specmask.orchestrator.client import OrchestratorClient, StreamedResult, build_request
from specmask.orchestrator.dev.local_stack import StackConfig
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import BOUNDED_SCHEMA, PROMPT, RAY_CALL_TIMEOUT_S, ThreadStack

pytestmark = pytest.mark.slow
LIVENESS_S = 1.0
BUDGET = 128
MAX_BATCH = 16
PROMPT_CHARS = 3600  # ~3k tokens on the tiny byte-level vocabulary
BURST = 16
# Cannot complete within the 4k context: the stream runs until the test closes it.
_ITEM = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
ENDLESS_SCHEMA = {"type": "array", "items": _ITEM, "minItems": 300, "maxItems": 300}


def _long_prompt(i: int) -> str:
    filler = "".join(f'{{"id": {j}, "ok": true, "level": "mid", "note": "item {i}-{j}"}}, ' for j in range(400))
    return f"{PROMPT}context {i}: [{filler[:PROMPT_CHARS]}]\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadStack]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    target, draft = build_tiny_model_pair(tmp_path_factory.mktemp("liveness-tiny"), max_position_embeddings=4096)
    config = StackConfig(
        target_dir=str(target),
        draft_dir=str(draft),
        mask_replicas=1,
        num_workers=2,
        log_dir=str(tmp_path_factory.mktemp("liveness-logs")),
    )
    s = ThreadStack(
        config,
        max_batch=MAX_BATCH,
        max_queue=64,
        default_max_tokens=32,
        step_timeout_s=LIVENESS_S,
        max_iteration_tokens=BUDGET,
    ).start()
    yield s
    s.stop()


def _metric(stack: ThreadStack, name: str) -> float:
    assert stack.running is not None
    return stack.running.server.metrics.registry.get_sample_value(name) or 0.0


def _run_all(address: str, requests: list[pb.GenerateRequest]) -> list[StreamedResult]:
    results = [StreamedResult() for _ in requests]

    def run(i: int) -> None:
        try:
            with OrchestratorClient(address) as client:
                for chunk in client.stream(requests[i], timeout_s=600):
                    results[i].add(chunk)
        except Exception as exc:  # a refused call is a failure the test reports, not a thread crash
            results[i].error = repr(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    return results


def _burst(n: int) -> list[pb.GenerateRequest]:
    return [build_request(_long_prompt(i), schema=BOUNDED_SCHEMA, max_tokens=32) for i in range(n)]


def test_a_burst_of_long_prompts_keeps_every_worker_and_the_running_stream(stack: ThreadStack) -> None:
    failures_before = _metric(stack, "specmask_worker_failures_total")
    arrivals: list[float] = []
    stream = StreamedResult()
    first = threading.Event()
    done = threading.Event()

    def run_stream() -> None:
        # One token an iteration (no drafts): the stream outlasts the burst's iterations within
        # the 4k context, however many the cost-sized chunks take.
        request = build_request(
            PROMPT, schema=ENDLESS_SCHEMA, temperature=1.0, seed=7, max_tokens=4000, speculation=False
        )
        with OrchestratorClient(stack.address) as client:
            for chunk in client.stream(request, timeout_s=600):
                stream.add(chunk)
                if chunk.token_ids:
                    arrivals.append(time.monotonic())
                    first.set()
                if done.is_set():
                    break  # closing the client cancels the stream

    streamer = threading.Thread(target=run_stream)
    streamer.start()
    assert first.wait(120), "the stream never started"
    burst_start = time.monotonic()
    results = _run_all(stack.address, _burst(BURST))
    burst_end = time.monotonic()
    done.set()
    assert stack.running is not None
    assert not stream.error, stream.error
    # Still running when the burst was done (not ended by the context, say).
    assert stream.finish_reason == pb.FINISH_REASON_UNSPECIFIED, stream.finish_reason_name
    errors = [(r.finish_reason, r.error) for r in results if r.error or r.finish_reason == pb.FINISH_REASON_ERROR]
    assert not errors, errors
    assert all(r.token_ids for r in results)
    assert stack.running.server.engine.worker_health() == [True, True]
    assert _metric(stack, "specmask_worker_failures_total") == failures_before
    during = [t for t in arrivals if burst_start <= t <= burst_end]
    # The stream emitted all through the burst: in every fifth of it, not just before and after.
    fifths = {int(5 * (t - burst_start) / (burst_end - burst_start)) for t in during}
    assert fifths >= {0, 1, 2, 3, 4}, (len(during), sorted(fifths), burst_end - burst_start)
    streamer.join(timeout=900)


def test_a_stopped_worker_requeues_what_had_not_started(stack: ThreadStack) -> None:
    import ray

    assert stack.running is not None
    actors = stack.running.server.worker_actors
    pid = ray.get(actors[0].info.remote(), timeout=RAY_CALL_TIMEOUT_S).pid
    requeued_before = _metric(stack, "specmask_requeued_requests_total")
    results: list[StreamedResult] = []

    def burst() -> None:
        results.extend(_run_all(stack.address, _burst(2 * MAX_BATCH)))

    runner = threading.Thread(target=burst)
    runner.start()
    # Wait until worker 0 holds prompts it is still prefilling, then stop it.
    deadline = time.monotonic() + 120
    while stack.worker_num_active()[0] < 4:
        assert time.monotonic() < deadline, "worker 0 never took the burst"
        time.sleep(0.05)
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while stack.running.server.engine.worker_health()[0]:
            assert time.monotonic() < deadline, "a stopped worker was never taken out"
            time.sleep(0.1)
    finally:
        os.kill(pid, signal.SIGCONT)
    runner.join(timeout=900)
    assert len(results) == 2 * MAX_BATCH
    assert _metric(stack, "specmask_requeued_requests_total") > requeued_before
    for r in results:
        if r.error:
            # Only a request that was already streaming may fail, and it says why.
            assert r.token_ids and "cut off" in r.error, (r.token_ids, r.error)
        else:
            assert r.token_ids and r.finish_reason != pb.FINISH_REASON_ERROR
    # The stopped worker, continued, answers again and is put back.
    deadline = time.monotonic() + 120
    while not all(stack.running.server.engine.worker_health()):
        assert time.monotonic() < deadline, "the continued worker was not put back"
        time.sleep(0.2)
