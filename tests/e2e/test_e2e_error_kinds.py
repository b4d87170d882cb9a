"""A failure's kind decides how each front door reports it, end to end (api/error_table.py):
a min_tokens the request's own grammar cannot reach is the caller's error, HTTP 400 naming the
field (unary and stream), and on gRPC a FINISH_REASON_ERROR response saying why."""

from __future__ import annotations

import json
from typing import Any

import httpx2 as httpx
import pytest

from specmask.gpu_worker.types import MIN_TOKENS_UNREACHABLE
from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import ThreadStack

pytestmark = pytest.mark.slow

_TIMEOUT = httpx.Timeout(300.0)
# The grammar's one sentence is "cd": a few tokens, so six output tokens cannot be met.
_UNREACHABLE = {"prompt": "code:", "guided_regex": "cd", "min_tokens": 6, "max_tokens": 20}


def _post(stack: ThreadStack, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{stack.http_url}/v1/completions",
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        timeout=_TIMEOUT,
    )


def test_unreachable_min_tokens_is_a_400_naming_the_field(stack: ThreadStack, model: str) -> None:
    resp = _post(stack, {"model": model, **_UNREACHABLE})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "min_tokens" and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(MIN_TOKENS_UNREACHABLE), error


def test_unreachable_min_tokens_ends_a_stream_with_that_error(stack: ThreadStack, model: str) -> None:
    events: list[Any] = []
    with httpx.stream(
        "POST",
        f"{stack.http_url}/v1/completions",
        content=json.dumps({"model": model, **_UNREACHABLE, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
        timeout=_TIMEOUT,
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[-1]["error"]["param"] == "min_tokens", events
    assert "[DONE]" not in events and not any(
        c.get("finish_reason") for e in events if isinstance(e, dict) for c in e.get("choices", [])
    ), events


def test_unreachable_min_tokens_on_grpc_is_an_error_response(stack: ThreadStack) -> None:
    msg = build_request("code:", regex="cd", max_tokens=20)
    msg.sampling.min_tokens = 6
    with OrchestratorClient(stack.address) as client:
        resp = client.generate(msg)
    assert resp.finish_reason == pb.FINISH_REASON_ERROR, resp
    assert resp.error.startswith(MIN_TOKENS_UNREACHABLE), resp.error
