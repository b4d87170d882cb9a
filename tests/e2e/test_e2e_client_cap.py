"""The per-client in-flight cap: one end client's flood queues behind its own cap,
another client is still admitted. Real stack (tests/e2e/stack.py), real gRPC; the client is
named by the ``specmask-client`` metadata (orchestrator.client_identity)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from specmask.mask_service.auth import CLIENT_METADATA_KEY
from specmask.orchestrator.client import OrchestratorClient, build_request
from tests.e2e.stack import LONG_MAX_TOKENS, LONG_SCHEMA, PROMPT, ThreadStack

CAP = 2


@pytest.fixture
def capped(stack: ThreadStack):
    """The shared stack with the cap set for this test (the engine reads its config per request)."""
    assert stack.running is not None
    engine = stack.running.server.engine

    async def set_cap(cap: int) -> None:
        engine._config = dataclasses.replace(engine._config, max_inflight_per_client=cap)

    stack.wait_idle()
    stack.run(set_cap(CAP))
    yield stack
    stack.run(set_cap(0))


def _long(i: int):
    return build_request(PROMPT, schema=LONG_SCHEMA, temperature=1.0, seed=i, max_tokens=LONG_MAX_TOKENS)


def test_one_clients_requests_past_its_cap_are_refused_others_admitted(capped: ThreadStack) -> None:
    flooder = ((CLIENT_METADATA_KEY, "flooder"),)
    with OrchestratorClient(capped.address) as client:
        held = [client.stub.GenerateStream(_long(i), timeout=120, metadata=flooder) for i in range(CAP)]
        try:
            for call in held:
                next(iter(call))  # admitted and generating: in flight
            with pytest.raises(grpc.RpcError) as info:
                client.stub.Generate(_long(99), timeout=60, metadata=flooder)
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "per-client limit" in info.value.details()
            # another client is admitted while the flooder is at its cap
            other = client.stub.Generate(
                build_request(PROMPT, schema=LONG_SCHEMA, temperature=0.0, max_tokens=8),
                timeout=60,
                metadata=((CLIENT_METADATA_KEY, "polite"),),
            )
            assert other.usage.completion_tokens > 0
        finally:
            for call in held:
                call.cancel()
    capped.wait_idle()
