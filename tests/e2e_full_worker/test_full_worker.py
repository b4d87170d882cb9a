"""A full worker's freed slot goes to the waiting request: the remove goes before the add.

When a request finishes in the orchestrator (a stop string in plain text: beside a grammar a
stop string may only end a complete document, which the worker ends itself) rather than on the worker, the
worker still holds its sequence until a remove() reaches it; the request waiting for that
slot is placed at once and goes with the next iterate() call, which removes before it adds
(``GpuWorker.iterate``). In the other order, a worker at ``max_batch`` refuses the add
("worker is full") and that request fails.
Its own stack: one replica, one worker, one slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.orchestrator.dev.local_stack import StackConfig
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import LONG_MAX_TOKENS, PROMPT, ThreadStack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadStack]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    target, draft = build_tiny_model_pair(tmp_path_factory.mktemp("full-worker-tiny"))
    config = StackConfig(target_dir=str(target), draft_dir=str(draft), mask_replicas=1, num_workers=1)
    s = ThreadStack(config, max_batch=1, max_queue=8).start()
    yield s
    s.stop()


def test_the_slot_a_stop_string_frees_goes_to_the_waiting_request(stack: ThreadStack) -> None:
    with OrchestratorClient(stack.address) as client:
        whole = client.generate(
            build_request(
                PROMPT, temperature=1.0, seed=7, max_tokens=LONG_MAX_TOKENS, ignore_eos=True, speculation=False
            )
        )
    # A seeded request replays the same text: a stop string from its middle ends each request
    # there, in the orchestrator (the worker would run on to max_tokens).
    middle = len(whole.text) // 2
    stop = whole.text[middle : middle + 8]
    cut = whole.text.index(stop)
    assert cut > 0, whole.text
    request = build_request(
        PROMPT, temperature=1.0, seed=7, max_tokens=LONG_MAX_TOKENS, ignore_eos=True, speculation=False, stop=[stop]
    )
    # Three at once on one slot: each waits in the queue until the one before's stop string frees it.

    def generate(_: int) -> pb.GenerateResponse:
        with OrchestratorClient(stack.address) as client:
            return client.generate(request, timeout_s=120)

    assert stack.running is not None
    value = stack.running.server.metrics.registry.get_sample_value

    def queued() -> tuple[float, float]:
        """specmask_request_queue_seconds: (observations, observations of 10 ms or less)."""
        return (
            value("specmask_request_queue_seconds_count") or 0.0,
            value("specmask_request_queue_seconds_bucket", {"le": "0.01"}) or 0.0,
        )

    before = queued()
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(generate, range(3)))
    after = queued()
    # Each request's wait for the slot is measured once, and the ones that waited for a whole
    # generation before them show it (a generation here takes tens of steps).
    assert after[0] - before[0] == 3.0
    assert after[1] - before[1] <= 1.0, (before, after)
    for r in results:
        assert r.finish_reason == pb.FINISH_REASON_STOP, (r.finish_reason, r.error)
        assert r.text == whole.text[:cut]
    active, sessions = stack.wait_idle()
    assert active == [0] and sessions == 0
