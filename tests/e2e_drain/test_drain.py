"""Graceful shutdown ends every stream with a final message.

SIGTERM used to cut each stream that needed more than the 5 s grace with a bare
UNAVAILABLE "Cancelling all calls". Now the engine drains: streams get
``shutdown_grace_s`` to finish, then each ends with FINISH_REASON_ERROR and a
message saying why. Its own stack (one replica, one worker), stopped by the
test the way SIGTERM stops `specmask orchestrator` (OrchestratorServer.stop).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from specmask.orchestrator.client import build_request
from specmask.orchestrator.dev.local_stack import StackConfig
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import ENDLESS_MAX_TOKENS, ENDLESS_SCHEMA, PROMPT, ThreadStack, stream_concurrently

pytestmark = pytest.mark.slow
# Well under the time the tiny model takes for ENDLESS_MAX_TOKENS on a fast, idle box (a
# second or so): a stream must still be running when the grace ends, whatever the box.
GRACE_S = 0.25


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadStack]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    target, draft = build_tiny_model_pair(tmp_path_factory.mktemp("drain-tiny"))
    config = StackConfig(target_dir=str(target), draft_dir=str(draft), mask_replicas=1, num_workers=1)
    s = ThreadStack(config, max_batch=8, max_queue=8, shutdown_grace_s=GRACE_S).start()
    yield s
    s.stop()  # a no-op once the test stopped it


def test_shutdown_drain_ends_streams_with_a_final_message(stack: ThreadStack) -> None:
    requests = [
        build_request(
            PROMPT,
            schema=ENDLESS_SCHEMA if i % 2 == 0 else None,
            temperature=1.0,
            seed=40 + i,
            max_tokens=ENDLESS_MAX_TOKENS,
            # The unconstrained one must not end on its own before the drain does (a
            # sampled EOS at temperature 1 would finish it with STOP on a fast box).
            ignore_eos=i % 2 == 1,
            speculation=False,
        )
        for i in range(3)
    ]
    stopper = threading.Thread(target=stack.stop)  # what SIGTERM does: OrchestratorServer.stop()
    # A stream cut by the server would raise grpc.RpcError out of stream_concurrently.
    results = stream_concurrently(stack.address, requests, on_started=stopper.start)
    stopper.join(60)
    for i, r in enumerate(results):
        assert r.finish_reason == pb.FINISH_REASON_ERROR, (i, r.finish_reason, r.error)
        assert "server shutting down" in r.error, (i, r.error)
        assert r.token_ids, i  # it had streamed tokens before the drain ended it
