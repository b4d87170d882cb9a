"""Proto <-> domain translation: round trips and structural errors."""

from __future__ import annotations

import dataclasses

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import FinishReason
from specmask.orchestrator import convert
from specmask.orchestrator.errors import InvalidRequest
from specmask.orchestrator.types import (
    GenerationRequest,
    GenerationResult,
    RequestOutput,
    SamplingOptions,
    SpeculationOptions,
    Usage,
)
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb


@pytest.mark.parametrize(
    "grammar",
    [
        None,
        GrammarSpec(
            GrammarKind.JSON_SCHEMA, '{"type":"integer"}', any_whitespace=True, separators=(", ", ": "), strict=False
        ),
        GrammarSpec(GrammarKind.REGEX, "[0-9]+"),
        GrammarSpec(GrammarKind.EBNF, 'root ::= "a"'),
        GrammarSpec(GrammarKind.LARK, 'start: "a"'),
        GrammarSpec(GrammarKind.ANY_JSON),
    ],
)
def test_request_round_trip(grammar) -> None:
    req = GenerationRequest(
        request_id="abc",
        prompt="hi" if grammar is None else (1, 2, 3),
        grammar=grammar,
        sampling=SamplingOptions(
            temperature=0.5,
            top_p=0.75,
            top_k=7,
            seed=2**64 - 1,
            max_tokens=9,
            stop=("x", "yz"),
            stop_token_ids=(0, 5, 2**31 - 1),
            include_stop_str_in_output=True,
            ignore_eos=grammar is None,
            logprobs=2,
            min_p=0.5,
            min_tokens=3,
        ),
        speculation=SpeculationOptions(enabled=True, k=3, proposers=("ngram", "draft_model"), draft_masking=False),
    )
    assert convert.request_from_proto(convert.request_to_proto(req), "abc") == req


def test_repeated_stop_token_ids_count_once() -> None:
    msg = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop_token_ids=[4, 2, 4, 2, 9]))
    assert convert.request_from_proto(msg, "id").sampling.stop_token_ids == (4, 2, 9)


def test_defaults_when_unset() -> None:
    req = convert.request_from_proto(pb.GenerateRequest(text="hi"), "id")
    assert req.sampling == SamplingOptions()
    assert req.speculation == SpeculationOptions()
    assert req.grammar is None


@pytest.mark.parametrize(
    "msg",
    [
        pb.GenerateRequest(),  # no prompt
        pb.GenerateRequest(text="x", grammar=pb.Grammar(any_whitespace=True)),  # grammar without a kind
        pb.GenerateRequest(text="x", speculation=pb.SpeculationParams(proposers=[0])),  # UNSPECIFIED
        pb.GenerateRequest(text="x", speculation=pb.SpeculationParams(proposers=[99])),  # unknown value
    ],
)
def test_structural_errors(msg) -> None:
    with pytest.raises(InvalidRequest):
        convert.request_from_proto(msg, "id")


def test_responses() -> None:
    usage = Usage(
        prompt_tokens=3, completion_tokens=8, target_forwards=4, drafts_proposed=10, drafts_accepted=5, mask_time_s=0.25
    )
    msg = convert.result_to_proto(GenerationResult("r", "text", (1, 2), FinishReason.GRAMMAR_COMPLETE, None, usage))
    assert msg.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE and msg.error == ""
    assert msg.usage.tokens_per_target_forward == 2.0 and msg.usage.acceptance_rate == 0.5
    delta = convert.output_to_proto(RequestOutput("r", (5,), "a"))
    assert delta.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not delta.HasField("usage")
    final = convert.output_to_proto(RequestOutput("r", (), "", FinishReason.ERROR, "boom", usage))
    assert final.finish_reason == pb.FINISH_REASON_ERROR and final.error == "boom"
    assert final.usage.completion_tokens == 8
    assert set(convert.FINISH_REASONS) == set(FinishReason)


def test_backend_checked_mode_and_grammar_report() -> None:
    """The grammar-engine fields: engine choice, checked mode, max_attempts in; the GrammarReport out."""
    from specmask.orchestrator.types import GrammarReport

    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, '{"uniqueItems":true}', backend="llguidance")
    req = GenerationRequest(request_id="abc", prompt="hi", grammar=spec, max_attempts=5, checked=True)
    msg = convert.request_to_proto(req)
    assert (msg.grammar.backend, msg.grammar.checked, msg.grammar.max_attempts) == ("llguidance", True, 5)
    assert convert.request_from_proto(msg, "abc") == req
    # Tri-state: false demands exact, unset leaves it to the server's --grammar-fallback.
    for checked in (False, None):
        sent = convert.request_to_proto(dataclasses.replace(req, checked=checked))
        assert sent.grammar.HasField("checked") is (checked is not None)
        assert convert.request_from_proto(sent, "abc").checked is checked
    # A spec that opts in itself (in-process callers) still says so on the wire.
    legacy = convert.request_to_proto(GenerationRequest("abc", "hi", dataclasses.replace(spec, checked=True)))
    assert legacy.grammar.HasField("checked") and legacy.grammar.checked
    plain = convert.request_to_proto(GenerationRequest("abc", "hi", spec))
    assert not plain.grammar.HasField("checked")
    msg.grammar.ClearField("max_attempts")
    assert convert.request_from_proto(msg, "abc").max_attempts is None
    report = GrammarReport("checked", "xgrammar", attempts=3, relaxed=("uniqueItems",))
    result = GenerationResult("abc", "[1]", (1,), FinishReason.GRAMMAR_COMPLETE, None, Usage(), grammar=report)
    got = convert.result_to_proto(result).grammar
    assert (got.enforcement, got.backend, got.attempts, list(got.relaxed)) == (
        pb.ENFORCEMENT_CHECKED,
        "xgrammar",
        3,
        ["uniqueItems"],
    )
    final = RequestOutput("abc", (), "", FinishReason.GRAMMAR_COMPLETE, usage=Usage(), grammar=report)
    assert convert.output_to_proto(final).grammar.enforcement == pb.ENFORCEMENT_CHECKED
    assert not convert.output_to_proto(RequestOutput("abc", (1,), "x")).HasField("grammar")
