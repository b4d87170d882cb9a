"""Checked mode and engine choice through the whole stack.

A schema no engine enforces exactly (``uniqueItems``) is served in checked mode
by default (the server's ``--grammar-fallback checked``) or when the request opts
in, and refused when the request demands exact enforcement (``checked`` false):
it is generated under its relaxation, checked at the end against the original
schema and regenerated on a violation: a violating output is never returned, and
a stream sends nothing of a discarded attempt.
"""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import ThreadStack

pytestmark = pytest.mark.slow

# Two items from {1, 2}, distinct: half of what the relaxed grammar allows breaks uniqueItems.
UNIQUE = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
# Unsatisfiable, though no cheap rule proves it (it takes reading the pattern), so it is served
# checked: every output of the relaxation (a string of at most one character) breaks the original.
NEVER = {"type": "string", "maxLength": 1, "not": {"pattern": "^[\\s\\S]?$"}}


def _checked(schema: dict, *, max_attempts: int | None = None, **kw) -> pb.GenerateRequest:
    req = build_request("x", schema=schema, max_tokens=24, **kw)
    req.grammar.checked = True
    if max_attempts is not None:
        req.grammar.max_attempts = max_attempts
    return req


def _attempts_metric(stack: ThreadStack, outcome: str) -> float:
    assert stack.running is not None
    registry = stack.running.server.metrics.registry
    return registry.get_sample_value("specmask_checked_attempts_total", {"outcome": outcome}) or 0.0


def test_checked_unique_items_never_returns_a_violation(stack: ThreadStack) -> None:
    resampled_before = _attempts_metric(stack, "resampled")
    attempts, completed = 0, 0
    with OrchestratorClient(stack.address) as client:
        exact = build_request("x", schema=UNIQUE, max_tokens=24)
        exact.grammar.checked = False  # demands exact enforcement: refused, never relaxed
        with pytest.raises(grpc.RpcError) as exc:
            client.generate(exact)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "uniqueItems" in exc.value.details()
        # Unset: the server's default fallback (checked) serves it.
        default = client.generate(build_request("x", schema=UNIQUE, max_tokens=24, temperature=1.0, seed=2))
        assert default.grammar.enforcement == pb.ENFORCEMENT_CHECKED and list(default.grammar.relaxed) == [
            "uniqueItems"
        ]
        if default.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE:
            jsonschema.validate(json.loads(default.text), UNIQUE)
        else:
            assert default.finish_reason == pb.FINISH_REASON_GRAMMAR_VIOLATION and default.text == ""
        for seed in range(8):
            result = client.generate(_checked(UNIQUE, max_attempts=6, temperature=1.0, seed=seed))
            report = result.grammar
            assert report.enforcement == pb.ENFORCEMENT_CHECKED and list(report.relaxed) == ["uniqueItems"]
            assert report.backend in ("xgrammar", "llguidance") and 1 <= report.attempts <= 6
            attempts += report.attempts
            if result.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE:
                jsonschema.validate(json.loads(result.text), UNIQUE)  # never a violation
                completed += 1
            else:  # every attempt failed: a typed error, and none of their text
                assert result.finish_reason == pb.FINISH_REASON_GRAMMAR_VIOLATION, result
                assert result.text == "" and "checked mode" in result.error
            # Seeded: the same request replays the same attempts and output.
            if seed == 0:
                again = client.generate(_checked(UNIQUE, max_attempts=6, temperature=1.0, seed=seed))
                assert (again.text, again.grammar.attempts) == (result.text, report.attempts)
    assert completed >= 1
    assert attempts > 8, "no attempt was ever resampled: the test did not exercise the loop"
    assert _attempts_metric(stack, "resampled") >= resampled_before + (attempts - 8)


def test_checked_exhausts_its_attempts_with_a_typed_error(stack: ThreadStack) -> None:
    with OrchestratorClient(stack.address) as client:
        result = client.generate(_checked(NEVER, max_attempts=3, temperature=1.0, seed=5))
        assert result.finish_reason == pb.FINISH_REASON_GRAMMAR_VIOLATION
        assert result.grammar.attempts == 3 and result.text == "" and "all 3 attempts" in result.error
        greedy = client.generate(_checked(NEVER, max_attempts=3))  # greedy: one attempt, then the error
        assert greedy.finish_reason == pb.FINISH_REASON_GRAMMAR_VIOLATION
        assert greedy.grammar.attempts == 1 and "greedy" in greedy.error
        for bad in (0, 99):
            with pytest.raises(grpc.RpcError) as exc:
                client.generate(_checked(NEVER, max_attempts=bad, temperature=1.0))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_attempts" in exc.value.details()


def test_checked_stream_holds_discarded_attempts(stack: ThreadStack) -> None:
    with OrchestratorClient(stack.address) as client:
        messages = list(client.stream(_checked(UNIQUE, max_attempts=6, temperature=1.0, seed=3)))
    final = messages[-1]
    assert final.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    texts = [m.text for m in messages[:-1] if m.text]
    assert len(texts) <= 1  # the passing attempt in one message, nothing of a failed one
    if final.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE:
        jsonschema.validate(json.loads("".join(m.text for m in messages)), UNIQUE)
    else:
        assert not texts and final.finish_reason == pb.FINISH_REASON_GRAMMAR_VIOLATION
    assert final.grammar.enforcement == pb.ENFORCEMENT_CHECKED


def test_backend_choice_is_honoured(stack: ThreadStack) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with OrchestratorClient(stack.address) as client:
        for backend, expected in (("", "xgrammar"), ("auto", "xgrammar"), ("llguidance", "llguidance")):
            for _ in range(2):  # deterministic
                req = build_request("x", schema=schema, max_tokens=24)
                req.grammar.backend = backend
                result = client.generate(req)
                assert result.grammar.backend == expected and result.grammar.enforcement == pb.ENFORCEMENT_EXACT
        req = build_request("x", schema=schema, max_tokens=24)
        req.grammar.backend = "outlines"
        with pytest.raises(grpc.RpcError) as exc:
            client.generate(req)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "known: auto, llguidance, xgrammar" in exc.value.details()


def test_http_extensions(stack: ThreadStack) -> None:
    import urllib.request

    url = stack.http_url + "/v1/completions"

    def post(body: dict) -> tuple[int, dict]:
        data = json.dumps({"model": "target", "prompt": "x", "max_tokens": 24, **body}).encode()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as rsp:
                return rsp.status, json.loads(rsp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, body = post({"guided_json": UNIQUE, "guided_checked": True, "guided_max_attempts": 6, "seed": 1})
    if status == 200:
        jsonschema.validate(json.loads(body["choices"][0]["text"]), UNIQUE)
        grammar = body["usage"]["specmask"]["grammar"]
        assert grammar["enforcement"] == "checked" and grammar["relaxed"] == ["uniqueItems"]
    else:
        assert status == 500 and "checked mode" in body["error"]["message"]
    # No guided_checked: the server's default fallback (checked) serves it, reported in usage.
    # guided_max_attempts alone is allowed: the server falls back to checked mode.
    assert stack.running is not None
    registry = stack.running.server.metrics.registry
    finished = {
        e: registry.get_sample_value("specmask_grammar_requests_total", {"enforcement": e}) or 0.0
        for e in ("exact", "checked")
    }
    served = 0
    for seed in (2, 3):
        status, body = post({"guided_json": UNIQUE, "temperature": 1.0, "seed": seed, "guided_max_attempts": 8})
        if status == 200:
            jsonschema.validate(json.loads(body["choices"][0]["text"]), UNIQUE)
            assert body["usage"]["specmask"]["grammar"]["enforcement"] == "checked"
            served += 1
        else:  # every attempt failed the end check: an error, never the invalid text
            assert status == 500 and "checked mode" in body["error"]["message"], body
    assert served >= 1  # half the relaxation's outputs pass: 8 attempts fail with p = 1/256
    status, body = post({"guided_json": UNIQUE, "guided_checked": False})  # demands exact: refused
    assert status == 400 and "uniqueItems" in body["error"]["message"]
    status, body = post({"guided_json": {"type": "integer"}})  # exact wherever it can be
    assert status == 200 and body["usage"]["specmask"]["grammar"]["enforcement"] == "exact"
    after = {
        e: registry.get_sample_value("specmask_grammar_requests_total", {"enforcement": e}) or 0.0 for e in finished
    }
    assert after["checked"] >= finished["checked"] + 2 and after["exact"] >= finished["exact"] + 1
    status, body = post({"guided_json": {"type": "integer"}, "guided_decoding_backend": "llguidance"})
    assert status == 200 and body["usage"]["specmask"]["grammar"]["backend"] == "llguidance"
    status, body = post({"guided_json": {"type": "integer"}, "guided_decoding_backend": "outlines"})
    assert status == 400 and body["error"]["param"] == "guided_decoding_backend"


def test_generate_cli_flags(stack: ThreadStack, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from specmask.orchestrator import generate_cli

    schema = tmp_path / "unique.json"
    schema.write_text(json.dumps(UNIQUE))
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    base = ["--address", stack.address, "--prompt", "x", "--schema", str(schema), "--max-tokens", "24", "--json"]
    assert generate_cli.run(parser.parse_args([*base, "--no-checked"])) == 1  # exact demanded: refused
    assert "uniqueItems" in capsys.readouterr().err
    checked = ["--checked", "--max-attempts", "6", "--temperature", "1", "--seed", "1", "--backend", "xgrammar"]
    generate_cli.run(parser.parse_args(base + checked))
    out = json.loads(capsys.readouterr().out)
    if out["finish_reason"] == "grammar_complete":
        jsonschema.validate(json.loads(out["text"]), UNIQUE)
    else:
        assert out["finish_reason"] == "grammar_violation" and out["text"] == ""
