"""Authentication over the real stack: API keys on HTTP and gRPC, the mask-service token, and
session release only by the owner that opened the sessions.

Its own stack (one mask replica, one worker, the tiny model pair), started the way `specmask up`
starts one: a mask-service token in the environment every tier inherits, API keys on the
orchestrator, a CORS origin on the HTTP API. Real HTTP and gRPC on 127.0.0.1.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmask.mask_service.auth import OWNER_SECRET_ENV, TOKEN_ENV, public_owner
from specmask.mask_service.client.mask_client import MaskServiceClient, MaskServiceError
from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.orchestrator.dev.local_stack import StackConfig
from tests.e2e.stack import LONG_MAX_TOKENS, LONG_SCHEMA, PROMPT, ThreadStack

pytestmark = pytest.mark.slow
KEY_A, KEY_B = "sk-test-alpha-0123456789", "sk-test-beta-9876543210"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadStack]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    saved = {k: os.environ.get(k) for k in (TOKEN_ENV, OWNER_SECRET_ENV)}
    os.environ[TOKEN_ENV] = "mask-token-for-this-stack"
    os.environ[OWNER_SECRET_ENV] = "owner-secret-for-this-stack"
    target, draft = build_tiny_model_pair(tmp_path_factory.mktemp("auth-tiny"))
    config = StackConfig(target_dir=str(target), draft_dir=str(draft), mask_replicas=1, num_workers=1)
    s = ThreadStack(
        config, max_batch=8, max_queue=8, http_port=0, api_keys=(KEY_A, KEY_B), cors_origins=(ORIGIN,)
    ).start()
    try:
        yield s
    finally:
        s.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _http(stack: ThreadStack) -> str:
    assert stack.running is not None
    return f"http://127.0.0.1:{stack.running.server.http_port}"


def test_http_needs_a_key_and_answers_401_in_openai_shape(stack: ThreadStack) -> None:
    base = _http(stack)
    with httpx.Client(timeout=60) as http:
        missing = http.get(f"{base}/v1/models")
        wrong = http.get(f"{base}/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        ok_a = http.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY_A}"})
        ok_b = http.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY_B}"})
        health = http.get(f"{base}/health")
        post = http.post(f"{base}/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 2})
    for resp in (missing, wrong, post):
        assert resp.status_code == 401, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key", error
        assert error["message"]
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert ok_a.status_code == ok_b.status_code == 200, (ok_a.text, ok_b.text)
    assert ok_a.json()["data"]
    assert health.status_code != 401  # probes carry no key


def test_http_cors_preflight_and_headers(stack: ThreadStack) -> None:
    base = _http(stack)
    with httpx.Client(timeout=60) as http:
        pre = http.options(
            f"{base}/v1/chat/completions",
            headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
        )
        other = http.options(
            f"{base}/v1/chat/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        labelled = http.get(f"{base}/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY_A}"})
        refused = http.get(f"{base}/v1/models", headers={"Origin": ORIGIN})
    assert pre.status_code == 204, pre.text
    assert pre.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "Authorization" in pre.headers["Access-Control-Allow-Headers"]
    assert other.status_code == 403
    assert labelled.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert refused.status_code == 401 and refused.headers["Access-Control-Allow-Origin"] == ORIGIN


def test_grpc_needs_a_key(stack: ThreadStack) -> None:
    req = build_request(PROMPT, any_json=True, max_tokens=4)
    with OrchestratorClient(stack.address) as client:
        for metadata in ((), (("authorization", "Bearer sk-wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                client.stub.Generate(req, timeout=60, metadata=metadata)
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            with pytest.raises(grpc.RpcError) as info:
                list(client.stub.GenerateStream(req, timeout=60, metadata=metadata))
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        resp = client.stub.Generate(req, timeout=120, metadata=(("authorization", f"Bearer {KEY_B}"),))
        assert resp.usage.completion_tokens > 0
    with grpc.insecure_channel(stack.address) as channel:  # health stays open for probes
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_mask_service_needs_the_stacks_token_and_owner_release_needs_the_whole_tag(stack: ThreadStack) -> None:
    assert stack.running is not None
    mask_address = stack.running.mask_services[0].address
    owner = stack.running.server.info.session_owner
    public = public_owner(owner)
    assert public.startswith("gpu-worker-") and owner != public  # what logs show is not the owner

    stranger = MaskServiceClient(mask_address, auth_token="", deadline_s=10.0, max_retries=0)
    with stranger, pytest.raises(MaskServiceError) as info:
        stranger.release_owner(public)
    assert info.value.code is grpc.StatusCode.UNAUTHENTICATED

    # A generation holds a session while a token holder tries the owner as a log shows it.
    done = threading.Event()
    result: list[object] = []
    req = build_request(PROMPT, schema=LONG_SCHEMA, temperature=1.0, seed=3, max_tokens=LONG_MAX_TOKENS)
    metadata = (("authorization", f"Bearer {KEY_A}"),)

    def run() -> None:
        try:
            with OrchestratorClient(stack.address) as client:
                result.append(client.stub.Generate(req, timeout=300, metadata=metadata))
        except BaseException as exc:
            result.append(exc)
        finally:
            done.set()

    started = threading.Thread(target=run, daemon=True)
    started.start()
    with MaskServiceClient(mask_address, deadline_s=10.0, max_retries=0) as holder:
        deadline = time.monotonic() + 120
        while holder.session_count() == 0 and not done.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        closed = holder.release_owner(public)
    assert closed == 0
    assert done.wait(300)
    (outcome,) = result
    assert not isinstance(outcome, BaseException), outcome
    assert outcome.finish_reason != 0 and not outcome.error, outcome  # type: ignore[attr-defined]
