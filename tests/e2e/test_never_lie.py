"""Never lie, through the whole stack: random grammars and sampling never return
an invalid output as complete, tiny temperatures stay in the grammar, and the
end-of-request check fails closed (a wrong output or a broken checker is a
GRAMMAR_VIOLATION, never a success)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path

import pytest

from bench.lie_cases import generate
from bench.lies import run_cases
from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import ThreadStack

pytestmark = pytest.mark.slow

# Small enough for CI (two loaded cores), large enough to mix every family and option.
NUM_RANDOM_REQUESTS = 48
SEED = 9


def _violations_metric(stack: ThreadStack, stage: str) -> float:
    assert stack.running is not None
    registry = stack.running.server.metrics.registry
    return registry.get_sample_value("specmask_grammar_violations_total", {"stage": stage}) or 0.0


def test_random_requests_never_lie(stack: ThreadStack) -> None:
    assert stack.running is not None
    # Seeded only: outputs replay exactly, so a failure here reproduces.
    cases = generate(SEED, NUM_RANDOM_REQUESTS, max_k=stack.running.config.max_k, max_tokens=40, seeded_only=True)
    tally = asyncio.run(run_cases(stack.address, cases, concurrency=8))
    summary = json.dumps(tally.summary(), indent=1)
    assert tally.requests == NUM_RANDOM_REQUESTS
    assert tally.violations == 0, summary
    assert tally.caught == 0, summary  # an invalid output was produced (and caught): still a bug
    assert tally.errors == 0, summary
    assert tally.completed >= NUM_RANDOM_REQUESTS // 4, summary  # the check is not vacuous


@pytest.mark.parametrize("speculation", [False, True])
@pytest.mark.parametrize("temperature", [1e-40, 1e-38])
@pytest.mark.parametrize("grammar", [{"regex": "[0-9]{5}"}, {"any_json": True}])
def test_tiny_temperature_keeps_the_grammar(
    stack: ThreadStack, speculation: bool, temperature: float, grammar: dict
) -> None:
    """Finding 2: temperature <= 1e-38 ended the first step with empty text reported GRAMMAR_COMPLETE."""
    req = build_request("x", temperature=temperature, seed=1, max_tokens=24, speculation=speculation, **grammar)
    with OrchestratorClient(stack.address) as client:
        result = client.generate(req)
    assert result.finish_reason in (pb.FINISH_REASON_GRAMMAR_COMPLETE, pb.FINISH_REASON_LENGTH), result.error
    if result.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE:
        if "regex" in grammar:
            assert re.fullmatch("[0-9]{5}", result.text), result.text
        else:
            json.loads(result.text)
    # Below the greedy floor the request is greedy: the same output as temperature 0.
    greedy = build_request("x", temperature=0.0, max_tokens=24, speculation=speculation, **grammar)
    with OrchestratorClient(stack.address) as client:
        assert client.generate(greedy).text == result.text


def _digit_token_ids(target_dir: Path) -> tuple[int, ...]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return tuple(i for s, i in tok.get_vocab().items() if s.isdigit() and s.isascii())


def test_wrong_output_is_a_violation_not_a_success(
    stack: ThreadStack, tiny_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real wrong output: every digit token is made a stop token for this request, so
    the worker ends a `[0-9]{5}` request at its first token and calls it GRAMMAR_COMPLETE
    with incomplete text. The end check must turn that into GRAMMAR_VIOLATION."""
    assert stack.running is not None
    engine = stack.running.server.engine
    digits = _digit_token_ids(tiny_pair[0])
    assert digits
    validate = engine._validator.validate_request

    def with_digit_stops(req):
        validated = validate(req)
        if not req.request_id.startswith("wrong-"):
            return validated
        return dataclasses.replace(validated, seq=dataclasses.replace(validated.seq, stop_token_ids=digits))

    monkeypatch.setattr(engine._validator, "validate_request", with_digit_stops)
    before = _violations_metric(stack, "output_check")
    with OrchestratorClient(stack.address) as client:
        result = client.generate(build_request("x", regex="[0-9]{5}", max_tokens=16, request_id="wrong-1"))
    assert result.finish_reason == pb.FINISH_REASON_GRAMMAR_VIOLATION, (result.finish_reason, result.text)
    assert "grammar violation" in result.error and "incomplete" in result.error
    assert _violations_metric(stack, "output_check") == before + 1


def test_checker_failure_fails_closed(stack: ThreadStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """If the end check itself breaks, the request is not reported complete."""
    from specmask.orchestrator.output_check import OutputCheckError

    assert stack.running is not None
    checker = stack.running.server.engine.output_checker

    def broken(spec, text, engine="", tokens=()):
        raise OutputCheckError("injected checker failure")

    monkeypatch.setattr(checker, "check", broken)
    with OrchestratorClient(stack.address) as client:
        result = client.generate(build_request("x", regex="(yes|no)", max_tokens=8, request_id="broken-check-1"))
    assert result.finish_reason == pb.FINISH_REASON_GRAMMAR_VIOLATION, result.finish_reason
    assert "could not be verified" in result.error and "injected checker failure" in result.error


_F1_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string"}},
    "required": ["a"],
    "patternProperties": {".*": {"type": "string"}},
}
_LOOP = {"$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}


class _NoValidOutput:
    """An empty language: any "complete" output is a lie."""

    def __repr__(self) -> str:  # a stable test id: xdist workers must collect the same names
        return "NO_VALID_OUTPUT"


NO_VALID_OUTPUT = _NoValidOutput()


def _finding_cases() -> list[tuple[str, pb.Grammar, dict, object]]:
    """(id, grammar, sampling, schema or regex to check or NO_VALID_OUTPUT) for findings 1 and 3."""
    schema = lambda s, **kw: pb.Grammar(json_schema=json.dumps(s), **kw)  # noqa: E731
    hot = dict(temperature=1.5, seed=1)
    return [
        ("f1-pattern-properties", schema(_F1_SCHEMA, allow_additional_properties=True), hot, _F1_SCHEMA),
        ("f1-strict", schema(_F1_SCHEMA), hot, _F1_SCHEMA),
        ("f3-anyof-empty", schema({"anyOf": []}), {}, NO_VALID_OUTPUT),
        ("f3-oneof-empty", schema({"oneOf": []}), {}, NO_VALID_OUTPUT),
        ("f3-ref-root", schema({"$ref": "#"}), {}, {"$ref": "#"}),
        ("f3-ref-loop", schema(_LOOP), {}, _LOOP),
        ("f3-maxlength-negative", schema({"type": "string", "maxLength": -1}), {}, NO_VALID_OUTPUT),
        ("f3-regex-empty", pb.Grammar(regex=r"[^\s\S]"), {}, NO_VALID_OUTPUT),
        ("f3-ebnf-loop", pb.Grammar(ebnf="root ::= root"), {}, NO_VALID_OUTPUT),
        ("f3-lark-loop", pb.Grammar(lark="start: start"), {}, NO_VALID_OUTPUT),
    ]


@pytest.mark.parametrize(("label", "grammar", "sampling", "truth"), _finding_cases(), ids=lambda v: str(v)[:24])
def test_finding_inputs_never_return_an_invalid_output_as_complete(
    stack: ThreadStack, label: str, grammar: pb.Grammar, sampling: dict, truth: object
) -> None:
    """Outputs that once broke their grammar (the compile-side fixes are refusals with a reason):
    whatever the grammar side does, the caller never gets an invalid output as a success.
    Allowed: refused (INVALID_ARGUMENT), GRAMMAR_VIOLATION, LENGTH, or a complete output that
    an independent check accepts."""
    import grpc

    from bench.lie_cases import json_check

    req = build_request("x", max_tokens=48, request_id=f"finding-{label}", **sampling)
    req.grammar.CopyFrom(grammar)
    with OrchestratorClient(stack.address) as client:
        try:
            result = client.generate(req)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
            return
    if result.finish_reason not in (pb.FINISH_REASON_GRAMMAR_COMPLETE, pb.FINISH_REASON_STOP):
        assert result.finish_reason in (pb.FINISH_REASON_GRAMMAR_VIOLATION, pb.FINISH_REASON_LENGTH), result
        return
    assert truth is not NO_VALID_OUTPUT, f"{label}: an empty language reported complete: {result.text!r}"
    assert json_check(truth, False, (",", ":"))(result.text) is None, (label, result.text)
