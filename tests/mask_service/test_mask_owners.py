"""Sessions belong to owners: per-owner limits, memory shedding, the shared token."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import MaskServiceClient, MaskServiceError
from specmask.mask_service.server.memory import MemoryGuard, rss_bytes
from specmask.mask_service.server.server import MaskServiceHandle, build_service
from tests.mask_service.service_config import make_config

SPEC = GrammarSpec(GrammarKind.REGEX, "[0-9]+")


@pytest.fixture(scope="module")
def guarded(bpe_dir, registry) -> Iterator[MaskServiceHandle]:
    cfg = make_config(bpe_dir, max_sessions=20, max_sessions_per_owner=3, auth_token="s3cret", compile_workers=1)
    handle = build_service(cfg, registry)
    handle.server.start()
    yield handle
    handle.stop(grace_s=0)


def _client(handle: MaskServiceHandle, token: str | None = "s3cret") -> MaskServiceClient:
    return MaskServiceClient(f"127.0.0.1:{handle.port}", deadline_s=20.0, max_retries=0, auth_token=token)


def test_one_owner_exhausting_its_sessions_does_not_block_another(guarded, bpe_id) -> None:
    with _client(guarded) as c:
        greedy = [c.open_session(bpe_id, SPEC, owner="greedy") for _ in range(3)]
        with pytest.raises(MaskServiceError) as info:
            c.open_session(bpe_id, SPEC, owner="greedy")
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "per-owner limit 3" in info.value.message
        other = c.open_session(bpe_id, SPEC, owner="polite")  # another owner still gets one
        c.close_session(greedy[0], owner="greedy")
        greedy.append(c.open_session(bpe_id, SPEC, owner="greedy"))  # closing frees the owner's slot
        assert c.release_owner("greedy") == 3
        c.close_session(other, owner="polite")
        assert c.session_count() == 0


def test_token_required_for_the_service_not_for_health(guarded, bpe_id) -> None:
    for token in ("", "wrong"):
        with _client(guarded, token) as c, pytest.raises(MaskServiceError) as info:
            c.open_session(bpe_id, SPEC)
        assert info.value.code is grpc.StatusCode.UNAUTHENTICATED
        assert "token" in info.value.message
    with grpc.insecure_channel(f"127.0.0.1:{guarded.port}") as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_memory_guard_sheds_new_sessions(guarded, bpe_id) -> None:
    assert rss_bytes() > 0
    assert MemoryGuard(1 << 50)() is None
    reason = MemoryGuard(1)()
    assert reason is not None and "over its limit" in reason
    store = guarded.sessions
    saved = store._memory_guard
    store._memory_guard = MemoryGuard(1)  # this replica is now "over its memory limit"
    try:
        with _client(guarded) as c, pytest.raises(MaskServiceError) as info:
            c.open_session(bpe_id, SPEC, owner="any")
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "shed" in info.value.message
    finally:
        store._memory_guard = saved
