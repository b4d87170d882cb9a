"""Truth at the HTTP edge, through the real stack over loopback (docs/api-errors.md).

* Stop strings beside a grammar never cut a sentence of the grammar: a stop match
  ends the output only where the grammar may end; elsewhere it is ignored.
* Bad input is a 4xx with a clear message: lone surrogates anywhere, loosely typed
  known fields, a non-JSON body, ``n: 0``, impossible lengths, a separator that
  is not JSON whitespace.
* ``/health`` follows the same readiness as gRPC health.
* A caught violation is a distinct ``grammar_violation`` error, and a stream ends
  with an unmistakable error event (no finish chunk, no ``[DONE]``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import jsonschema
import pytest

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.orchestrator.dev.local_stack import health_status
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import BOUNDED_SCHEMA, PROMPT, ThreadStack

pytestmark = pytest.mark.slow

NOT_SERVING = 2  # grpc.health.v1 HealthCheckResponse.NOT_SERVING
SERVING = 1
_TIMEOUT = httpx.Timeout(300.0)


@pytest.fixture(scope="module")
def base_url(stack: ThreadStack) -> str:
    return stack.http_url


def _post(base_url: str, path: str, body: dict[str, Any] | str, **headers: str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(
        f"{base_url}{path}",
        content=content.encode(),
        headers={"Content-Type": "application/json", **headers},
        timeout=_TIMEOUT,
    )


def _sse(base_url: str, path: str, body: dict[str, Any], **headers: str) -> list[Any]:
    """The stream's events, parsed (``"[DONE]"`` kept as the string)."""
    events: list[Any] = []
    with httpx.stream(
        "POST",
        f"{base_url}{path}",
        content=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json", **headers},
        timeout=_TIMEOUT,
    ) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- stop strings next to a grammar --------------------------------------------------------

_CHAT = [{"role": "user", "content": PROMPT}]
_CHOICES = ["alpha", "beta"]
_REGEX = r"[a-z]{3}-\d{3}"
_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": BOUNDED_SCHEMA}}
STOP_CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "schema_close_brace": ({"response_format": _SCHEMA_FORMAT}, ["}"]),
    "schema_open_brace": ({"response_format": _SCHEMA_FORMAT}, ["{"]),
    "schema_comma_colon": ({"response_format": _SCHEMA_FORMAT}, [",", ":"]),
    "choice": ({"guided_choice": _CHOICES}, ["l", "e"]),
    "regex": ({"guided_regex": _REGEX}, ["-"]),
}


def _in_language(case: str, text: str) -> bool:
    if case.startswith("schema"):
        try:
            jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if case == "choice":
        return text in _CHOICES
    return re.fullmatch(_REGEX, text) is not None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(STOP_CASES))
def test_stop_string_never_cuts_a_grammar(base_url: str, model: str, case: str, stream: bool) -> None:
    """A stop match inside a sentence of the grammar is ignored: "stop" always means a sentence."""
    extra, stop = STOP_CASES[case]
    body = {
        "model": model,
        "messages": _CHAT,
        "stop": stop,
        "max_tokens": 200,
        "temperature": 0,
        "schema_instruction": "",
        **extra,
    }
    if stream:
        events = _sse(base_url, "/v1/chat/completions", body)
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [e for e in events if isinstance(e, dict)]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        finish = next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"])
    else:
        resp = _post(base_url, "/v1/chat/completions", body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    # Every grammar here is bounded and completes well within max_tokens: "stop", and a sentence.
    assert finish == "stop", (finish, text)
    assert _in_language(case, text), (case, text)


def test_stop_string_where_the_grammar_may_end_stops_there(base_url: str, model: str) -> None:
    """ "ab" is a sentence of ab|abc: a stop at "c" may end the output there (or the model chose "ab")."""
    body = {"model": model, "prompt": "x", "guided_choice": ["ab", "abc"], "stop": ["c"], "max_tokens": 8}
    for seed in range(4):
        resp = _post(base_url, "/v1/completions", {**body, "seed": seed, "temperature": 1.0})
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("ab", "stop"), choice


def test_grpc_stop_is_never_outside_the_grammar(stack: ThreadStack) -> None:
    """gRPC says STOP only for a sentence of the grammar (the end check covers STOP too)."""
    with OrchestratorClient(stack.address) as client:
        for seed in range(3):
            req = build_request(
                "x", regex=_REGEX, stop=["-"], max_tokens=24, temperature=1.0, seed=seed, speculation=seed % 2 == 0
            )
            result = client.generate(req)
            assert result.finish_reason in (
                pb.FINISH_REASON_STOP,
                pb.FINISH_REASON_GRAMMAR_COMPLETE,
                pb.FINISH_REASON_LENGTH,
            ), result
            if result.finish_reason != pb.FINISH_REASON_LENGTH:
                assert re.fullmatch(_REGEX, result.text), result.text


# ---- bad input is a 4xx ---------------------------------------------------------------------

_SURROGATE = "\\ud800"  # a JSON escape of a lone surrogate: valid JSON, not encodable text
_TOOL = (
    '[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"const":"xSURR"}}}}}]'
)
SURROGATE_BODIES: dict[str, tuple[str, str]] = {
    "message_content": ("/v1/chat/completions", '{"model":M,"messages":[{"role":"user","content":"aSURR"}]}'),
    "completion_prompt": ("/v1/completions", '{"model":M,"prompt":"aSURR"}'),
    "const": ("/v1/completions", '{"model":M,"prompt":"a","guided_json":{"const":"xSURR"}}'),
    "guided_regex": ("/v1/completions", '{"model":M,"prompt":"a","guided_regex":"xSURR"}'),
    "guided_choice": ("/v1/completions", '{"model":M,"prompt":"a","guided_choice":["xSURR","y"]}'),
    "stop": ("/v1/completions", '{"model":M,"prompt":"a","stop":["xSURR"]}'),
    "tools": (
        "/v1/chat/completions",
        '{"model":M,"messages":[{"role":"user","content":"a"}],"tool_choice":"required","tools":' + _TOOL + "}",
    ),
}


@pytest.mark.parametrize("where", sorted(SURROGATE_BODIES))
def test_lone_surrogate_is_a_400(base_url: str, model: str, where: str) -> None:
    path, template = SURROGATE_BODIES[where]
    raw = template.replace("M", json.dumps(model), 1).replace("SURR", _SURROGATE)
    json.loads(raw)  # valid JSON
    resp = _post(base_url, path, raw)
    assert resp.status_code == 400, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "surrogate" in error["message"], error


BAD_TYPES: dict[str, tuple[dict[str, Any], str]] = {
    "max_tokens_string": ({"max_tokens": "10"}, "max_tokens"),
    "max_tokens_bool": ({"max_tokens": True}, "max_tokens"),
    "stream_string": ({"stream": "yes"}, "stream"),
    "seed_float": ({"seed": 1.5}, "seed"),
    "temperature_string": ({"temperature": "0.5"}, "temperature"),
    "top_k_bool": ({"top_k": False}, "top_k"),
}


@pytest.mark.parametrize("case", sorted(BAD_TYPES))
def test_known_fields_are_strictly_typed(base_url: str, model: str, case: str) -> None:
    extra, field = BAD_TYPES[case]
    resp = _post(base_url, "/v1/completions", {"model": model, "prompt": "a", **extra})
    assert resp.status_code == 400, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert error["param"] == field and field in error["message"], error


def test_integral_float_and_int_temperature_still_pass(base_url: str, model: str) -> None:
    """Strict types keep what JSON clients send for numbers: an int where a float is expected."""
    resp = _post(base_url, "/v1/completions", {"model": model, "prompt": "a", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text


def test_non_json_body_is_refused(base_url: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "a", "max_tokens": 2}).encode()
    resp = httpx.post(
        f"{base_url}/v1/completions", content=body, headers={"Content-Type": "text/plain"}, timeout=_TIMEOUT
    )
    assert resp.status_code == 415, (resp.status_code, resp.text)
    assert "application/json" in resp.json()["error"]["message"]


def test_n_zero_says_n_must_be_at_least_one(base_url: str, model: str) -> None:
    resp = _post(base_url, "/v1/completions", {"model": model, "prompt": "a", "n": 0})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "n" and ">= 1" in error["message"] and "not supported" not in error["message"], error


@pytest.mark.parametrize("budget", [{"max_tokens": 64}, {}])
@pytest.mark.parametrize(
    "schema",
    [{"type": "string", "minLength": 100000}, {"type": "array", "items": {"type": "integer"}, "minItems": 1000000}],
)
def test_impossible_lengths_are_refused(
    base_url: str, model: str, schema: dict[str, Any], budget: dict[str, int]
) -> None:
    """Whatever max_tokens says, the shortest document exceeds the context: refused, not run to length."""
    resp = _post(base_url, "/v1/completions", {"model": model, "prompt": "a", "guided_json": schema, **budget})
    assert resp.status_code == 400, (resp.status_code, resp.text)
    message = resp.json()["error"]["message"]
    assert "max_tokens" in message and "at least" in message, message


def test_huge_schema_is_never_refused_for_the_servers_text(base_url: str, model: str) -> None:
    """A schema far larger than the context is not put into the prompt unless asked for, and when
    asked for and it does not fit, it is left out: the request is never refused for text the server
    added (the schema still constrains the output)."""
    # Several times the tiny model's context when written into the prompt; compiles in well under a second.
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(200)}}
    for extra in ({}, {"schema_instruction": "default"}):
        body = {
            "model": model,
            "messages": _CHAT,
            "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
            **extra,
        }
        resp = _post(base_url, "/v1/chat/completions", body)
        assert resp.status_code == 200, (extra, resp.status_code, resp.text)
        assert resp.json()["choices"][0]["finish_reason"] in {"stop", "length"}


def test_separator_outside_json_whitespace_is_refused(stack: ThreadStack) -> None:
    """U+00A0 is whitespace to Python's str.strip but not to JSON: refused at validation."""
    req = build_request("x", schema={"type": "object"}, max_tokens=8)
    req.grammar.separators.item = ",\u00a0"
    req.grammar.separators.key = ":"
    with OrchestratorClient(stack.address) as client, pytest.raises(grpc.RpcError) as exc:
        client.generate(req)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value  # type: ignore[attr-defined]
    assert "separator" in exc.value.details()  # type: ignore[attr-defined]


# ---- caught violations ------------------------------------------------------------------------

# Checked mode: every output fails the end check (unsatisfiable, but only the pattern shows it, so
# it is not refused up front).
NEVER = {"type": "string", "maxLength": 1, "not": {"pattern": "^[\\s\\S]?$"}}


def test_caught_violation_is_a_distinct_error(base_url: str, model: str) -> None:
    body = {
        "model": model,
        "prompt": "x",
        "guided_json": NEVER,
        "guided_checked": True,
        "temperature": 0,
        "max_tokens": 24,
    }
    resp = _post(base_url, "/v1/completions", body)
    assert resp.status_code == 500, resp.text
    error = resp.json()["error"]
    assert error["code"] == "grammar_violation" and error["type"] == "grammar_violation", error
    events = _sse(base_url, "/v1/completions", body)
    assert "[DONE]" not in events, events
    assert events[-1]["error"]["code"] == "grammar_violation", events
    assert not any(e.get("choices") and e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict))


def _digit_token_ids(target_dir: Path) -> tuple[int, ...]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return tuple(i for s, i in tok.get_vocab().items() if s.isdigit() and s.isascii())


def test_streamed_violation_ends_with_an_error_event(
    stack: ThreadStack,
    tiny_pair: tuple[Path, Path],
    base_url: str,
    model: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exact-mode output the worker wrongly calls complete (its digits made stop tokens):
    the stream ends with a grammar_violation error event, no finish chunk, no [DONE], and
    what it delivered is not a sentence of the grammar."""
    assert stack.running is not None
    engine = stack.running.server.engine
    digits = _digit_token_ids(tiny_pair[0])
    validate = engine._validator.validate_request

    def with_digit_stops(req):  # type: ignore[no-untyped-def]
        validated = validate(req)
        if not req.request_id.startswith("wrong-http-"):
            return validated
        return dataclasses.replace(validated, seq=dataclasses.replace(validated.seq, stop_token_ids=digits))

    monkeypatch.setattr(engine._validator, "validate_request", with_digit_stops)
    body = {"model": model, "prompt": "x", "guided_regex": "a[0-9]{5}", "max_tokens": 16, "temperature": 0}
    events = _sse(base_url, "/v1/completions", body, **{"X-Request-Id": f"wrong-http-{uuid.uuid4().hex[:8]}"})
    assert "[DONE]" not in events, events
    error = events[-1]["error"]
    assert error["code"] == "grammar_violation" and "grammar violation" in error["message"], error
    assert not any(e.get("choices") and e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict))
    streamed = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))
    assert re.fullmatch("a[0-9]{5}", streamed) is None


# ---- health and outages --------------------------------------------------------------------------


def test_http_health_follows_readiness_and_outage_is_503(stack: ThreadStack, base_url: str, model: str) -> None:
    """Every mask replica killed: once gRPC readiness is NOT_SERVING, /health is 503 too, and a
    grammar request is a 503 "mask tier unavailable" that names no internal address."""
    assert stack.running is not None
    replicas = stack.running.mask_services
    stack.wait_idle()
    try:
        for r in replicas:
            r.kill()
        deadline = time.monotonic() + 60
        while health_status(stack.address) != NOT_SERVING:
            assert time.monotonic() < deadline, "gRPC readiness never went NOT_SERVING"
            time.sleep(0.1)
        health = httpx.get(f"{base_url}/health", timeout=_TIMEOUT)
        assert health.status_code == 503, health.text
        schema = {"type": "object", "properties": {uuid.uuid4().hex: {"type": "integer"}}}
        resp = _post(base_url, "/v1/completions", {"model": model, "prompt": "a", "guided_json": schema})
        assert resp.status_code == 503, resp.text
        message = resp.json()["error"]["message"]
        assert "mask tier unavailable" in message and "127.0.0.1" not in message and "ipv4" not in message, message
        grpc_req = build_request("a", schema={"type": "object", "properties": {uuid.uuid4().hex: {}}}, max_tokens=8)
        with OrchestratorClient(stack.address) as client, pytest.raises(grpc.RpcError) as down:
            client.generate(grpc_req)
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE, down.value  # type: ignore[attr-defined]
        details = down.value.details()  # type: ignore[attr-defined]
        assert "mask tier unavailable" in details and "127.0.0.1" not in details, details
    finally:
        for r in replicas:
            r.start(wait=False)
        for r in replicas:
            r.wait_serving()
    deadline = time.monotonic() + 60
    while health_status(stack.address) != SERVING or httpx.get(f"{base_url}/health").status_code != 200:
        assert time.monotonic() < deadline, "readiness did not come back"
        time.sleep(0.2)
    stack.assert_replicas_serving()
