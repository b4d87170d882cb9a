"""Request validation before any GPU work: typed INVALID_ARGUMENT for everything a client can get wrong."""

from __future__ import annotations

import dataclasses
import json
import math

import grpc
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.gpu_worker.types import WorkerInfo
from specmask.orchestrator.errors import InvalidRequest, Unavailable
from specmask.orchestrator.grammar_check import MaskServiceGrammarChecker
from specmask.orchestrator.types import GenerationRequest, SamplingOptions, SpeculationOptions
from specmask.orchestrator.validation import MAX_STOP_STRINGS, GrammarFallback, RequestValidator, ServingDefaults

MAX_MODEL_LEN = 64
MAX_K = 6


@pytest.fixture(scope="module")
def info(bpe_dir, bpe_tokenizer) -> WorkerInfo:
    return WorkerInfo(
        vocab_size=bpe_tokenizer.get_vocab_size(),
        max_model_len=MAX_MODEL_LEN,
        tokenizer_id=tokenizer_id_for_path(bpe_dir),
        eos_token_ids=(0,),
        device="cpu",
        has_draft_model=True,
        max_k=MAX_K,
    )


@pytest.fixture(scope="module")
def checker(info, mask_service_address):
    c = MaskServiceGrammarChecker(
        (mask_service_address,),
        tokenizer_id=info.tokenizer_id,
        vocab_size=info.vocab_size,
        deadline_s=10.0,
        max_retries=1,
    )
    yield c
    c.close()


@pytest.fixture(scope="module")
def validator(bpe_tokenizer, info, checker) -> RequestValidator:
    return RequestValidator(bpe_tokenizer, info, checker, ServingDefaults(max_tokens=32, k=4))


def _req(prompt="hello", grammar=None, **kw) -> GenerationRequest:
    sampling = SamplingOptions(**{k: v for k, v in kw.items() if k in SamplingOptions.__dataclass_fields__})
    spec = SpeculationOptions(**{k: v for k, v in kw.items() if k in SpeculationOptions.__dataclass_fields__})
    return GenerationRequest(request_id="r1", prompt=prompt, grammar=grammar, sampling=sampling, speculation=spec)


SCHEMA = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))


def test_valid_request_becomes_a_sequence(validator, bpe_tokenizer) -> None:
    seq = validator.validate(_req("hello", SCHEMA, temperature=0.7, top_k=10**9, seed=2**64 - 1, stop=("x",)))
    assert seq.seq_id == "r1"
    assert seq.request_id == "r1"  # travels to the worker and its mask session (one id in all logs)
    assert seq.prompt_token_ids == tuple(bpe_tokenizer.encode("hello").ids)
    assert seq.grammar == dataclasses.replace(SCHEMA, checked=True)  # the server's fallback: checked
    assert seq.sampling.temperature == pytest.approx(0.7)
    assert seq.sampling.top_k == 0  # >= vocab size means off
    assert 0 <= seq.sampling.seed < 2**63  # kernels take int64
    assert seq.sampling.max_tokens == 32  # the server default
    assert seq.speculation.enabled and seq.speculation.k == 4


@pytest.mark.parametrize(
    ("temperature", "expected"), [(1e-40, 0.0), (5e-324, 0.0), (1e-38, 0.0), (9.9e-6, 0.0), (1e-5, 1e-5), (0.0, 0.0)]
)
def test_tiny_temperature_is_greedy(validator, temperature: float, expected: float) -> None:
    """Below GREEDY_TEMPERATURE_FLOOR the request is greedy (denormal
    temperatures made the logits infinite and let EOS through outside the grammar)."""
    assert validator.validate(_req(temperature=temperature)).sampling.temperature == expected


def test_default_max_tokens_is_capped_by_context(validator) -> None:
    prompt = tuple(range(1, MAX_MODEL_LEN - 4))  # 59 tokens: 5 left
    assert validator.validate(_req(prompt)).sampling.max_tokens == 5


def test_no_default_max_tokens_means_the_rest_of_the_context(bpe_tokenizer, info, checker) -> None:
    """The server default (None, as vLLM and OpenAI): a request naming no budget may use all the room."""
    v = RequestValidator(bpe_tokenizer, info, checker, ServingDefaults(max_tokens=None, k=4))
    prompt = tuple(range(1, 11))
    assert v.validate(_req(prompt)).sampling.max_tokens == MAX_MODEL_LEN - 10
    assert v.validate(_req(prompt, max_tokens=3)).sampling.max_tokens == 3


def test_stop_tokens(validator) -> None:
    assert validator.validate(_req()).stop_token_ids is None  # the tokenizer's EOS ids
    assert validator.validate(_req(ignore_eos=True)).stop_token_ids == ()  # none: only max_tokens ends it


def test_speculation_off(validator) -> None:
    seq = validator.validate(_req(enabled=False))
    assert not seq.speculation.enabled and seq.speculation.k == 0
    assert not validator.validate(_req(k=0)).speculation.enabled


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (_req(""), "prompt is empty"),
        (_req(()), "prompt is empty"),
        (_req((1, 10**6)), "outside the vocabulary"),
        (_req(tuple(range(1, MAX_MODEL_LEN + 1))), "context"),
        (_req("x" * (64 * MAX_MODEL_LEN + 1)), "longer than the model"),
        (_req(temperature=-0.1), "temperature"),
        (_req(temperature=math.nan), "temperature"),
        (_req(temperature=math.inf), "temperature"),
        (_req(temperature=1e9), "temperature"),
        (_req(top_p=0.0), "top_p"),
        (_req(top_p=1.5), "top_p"),
        (_req(top_p=math.nan), "top_p"),
        (_req(top_k=-1), "top_k"),
        (_req(max_tokens=0), "max_tokens"),
        (_req(max_tokens=-5), "max_tokens"),
        (_req(max_tokens=MAX_MODEL_LEN), "exceeds"),
        (_req(stop=("",)), "stop strings"),
        (_req(stop=("x" * 1000,)), "stop strings"),
        (_req(stop=tuple(str(i) for i in range(MAX_STOP_STRINGS + 1))), "stop strings"),
        (_req(k=MAX_K + 1), "k must be"),
        (_req(k=-1), "k must be"),
        (_req(enabled=False, k=3), "disabled"),
        (_req(enabled=False, proposers=("ngram",)), "disabled"),
        (_req(proposers=("oracle",)), "unknown proposers"),
        (_req(proposers=()), "must not be empty"),
        (_req(grammar=GrammarSpec(GrammarKind.REGEX, "a+", any_whitespace=True)), "JSON options"),
        (_req(grammar=GrammarSpec(GrammarKind.EBNF, "   ")), "empty"),
        (_req(grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, "{}", separators=("x", ":"))), "separator"),
        (_req(grammar=SCHEMA, ignore_eos=True), "ignore_eos"),
    ],
)
def test_invalid_requests(validator, req: GenerationRequest, needle: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        validator.validate(req)
    assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert needle in exc.value.message


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec(GrammarKind.JSON_SCHEMA, "{not json"),
        GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object", "not": {"required": ["a"]}})),
        GrammarSpec(GrammarKind.REGEX, "(unclosed"),
        GrammarSpec(GrammarKind.EBNF, "root ::= undefined_rule"),
    ],
)
def test_grammar_refused_by_the_mask_service_carries_its_message(validator, spec: GrammarSpec) -> None:
    with pytest.raises(InvalidRequest) as exc:  # checked=False: exact or refused, never relaxed
        validator.validate(dataclasses.replace(_req(grammar=spec), checked=False))
    assert exc.value.message.startswith("grammar refused: ")
    assert len(exc.value.message) > len("grammar refused: ")


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec(GrammarKind.REGEX, "[a-z]+"),
        GrammarSpec(GrammarKind.EBNF, 'root ::= "yes" | "no"'),
        GrammarSpec(GrammarKind.ANY_JSON),
        GrammarSpec(GrammarKind.JSON_SCHEMA, "{}", separators=(", ", ": ")),
    ],
)
def test_grammar_kinds_accepted(validator, spec: GrammarSpec) -> None:
    # A JSON Schema carries the server's fallback (checked by default); an exact one stays exact.
    expected = dataclasses.replace(spec, checked=True) if spec.kind is GrammarKind.JSON_SCHEMA else spec
    got = validator.validate_request(_req(grammar=spec))
    assert got.seq.grammar == expected and got.grammar is not None and got.grammar.enforcement == "exact"


def test_unreachable_mask_service_is_unavailable(bpe_tokenizer, info) -> None:
    from specmask.orchestrator.dev.local_stack import free_port

    checker = MaskServiceGrammarChecker(
        (f"127.0.0.1:{free_port()}",),
        tokenizer_id=info.tokenizer_id,
        vocab_size=info.vocab_size,
        deadline_s=0.5,
        max_retries=0,
    )
    try:
        v = RequestValidator(bpe_tokenizer, info, checker, ServingDefaults(max_tokens=8, k=2))
        with pytest.raises(Unavailable):
            v.validate(_req(grammar=SCHEMA))
    finally:
        checker.close()


@pytest.mark.parametrize("rid", ["a b", "x" * 129, "tab\there", "ünï", "new\nline"])
def test_bad_request_ids(rid: str) -> None:
    with pytest.raises(InvalidRequest):
        RequestValidator.request_id(rid)


def test_request_ids() -> None:
    assert RequestValidator.request_id("client-1") == "client-1"
    a, b = RequestValidator.request_id(""), RequestValidator.request_id("")
    assert a != b and len(a) == 32


UNIQUE = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}


def test_backend_and_checked_mode(validator) -> None:
    """Engine choice and checked mode through validation; bad values are typed errors."""
    exact = validator.validate_request(_req(grammar=SCHEMA, temperature=1.0))
    assert (exact.grammar.enforcement, exact.grammar.backend, exact.max_attempts) == ("exact", "xgrammar", 1)
    named = validator.validate_request(_req(grammar=dataclasses.replace(SCHEMA, backend="llguidance")))
    assert named.grammar.backend == "llguidance" and named.seq.grammar.backend == "llguidance"
    auto = validator.validate_request(_req(grammar=dataclasses.replace(SCHEMA, backend="auto")))
    assert auto.seq.grammar.backend == "" and auto.grammar.backend == "xgrammar"  # "auto" = the service picks
    with pytest.raises(InvalidRequest) as exc:
        validator.validate(_req(grammar=dataclasses.replace(SCHEMA, backend="outlines")))
    assert "known: auto, llguidance, xgrammar" in exc.value.message and exc.value.reason == "UNKNOWN_BACKEND"
    unique = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(UNIQUE))
    with pytest.raises(InvalidRequest, match="uniqueItems"):  # checked=False demands exact: refused
        validator.validate(dataclasses.replace(_req(grammar=unique, temperature=1.0), checked=False))
    checked = dataclasses.replace(unique, checked=True)
    got = validator.validate_request(_req(grammar=checked, temperature=1.0))
    assert (got.grammar.enforcement, got.grammar.relaxed, got.max_attempts) == ("checked", ("uniqueItems",), 4)
    req = dataclasses.replace(_req(grammar=checked, temperature=1.0), max_attempts=8)
    assert validator.validate_request(req).max_attempts == 8
    assert validator.validate_request(_req(grammar=checked)).max_attempts == 1  # greedy: a resample repeats
    for bad in (0, 9):
        with pytest.raises(InvalidRequest, match="max_attempts must be in"):
            validator.validate(dataclasses.replace(_req(grammar=checked, temperature=1.0), max_attempts=bad))
    with pytest.raises(InvalidRequest, match="checked mode only"):
        validator.validate(dataclasses.replace(_req(grammar=SCHEMA), max_attempts=2, checked=False))
    with pytest.raises(InvalidRequest, match="checked mode only"):
        validator.validate(dataclasses.replace(_req(grammar=GrammarSpec(GrammarKind.REGEX, "[a-z]+")), max_attempts=2))
    with pytest.raises(InvalidRequest, match="JSON Schema grammars only"):
        validator.validate(_req(grammar=GrammarSpec(GrammarKind.REGEX, "[a-z]+", checked=True)))


def test_schema_that_cannot_fit_is_refused_before_the_mask_service(validator, bpe_tokenizer) -> None:
    """The shortest document must fit the context, and the default budget when none is given;
    a max_tokens the client chose below it is its call (the output ends by length)."""
    longest = max(len(piece) for piece in bpe_tokenizer.get_vocab())

    def schema(tokens: int) -> GrammarSpec:
        return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "string", "minLength": tokens * longest}))

    with pytest.raises(InvalidRequest) as exc:
        validator.validate(_req("hello", schema(MAX_MODEL_LEN), max_tokens=8))
    assert "fit in the context" in exc.value.message and "at least" in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        validator.validate(_req("hello", schema(40)))  # the default budget is 32
    assert "max_tokens defaults to 32" in exc.value.message
    assert validator.validate(_req("hello", schema(40), max_tokens=8)).sampling.max_tokens == 8


def test_separator_must_use_json_whitespace(validator) -> None:
    for bad in (",\u00a0", "\u2028,"):
        with pytest.raises(InvalidRequest, match="JSON whitespace"):
            validator.validate(_req("hello", dataclasses.replace(SCHEMA, separators=(bad, ":"))))
    assert validator.validate(_req("hello", dataclasses.replace(SCHEMA, separators=(",\t", " : "))))


def test_min_p_and_min_tokens(validator) -> None:
    seq = validator.validate(_req(min_p=0.25, min_tokens=4, max_tokens=10, stop_token_ids=(7, 9)))
    assert seq.sampling.min_p == 0.25 and seq.sampling.min_tokens == 4
    assert seq.sampling.min_tokens_stop_ids == (7, 9)  # suppressed beside EOS before the minimum
    assert validator.validate(_req(min_p=1.0, min_tokens=10, max_tokens=10)).sampling.min_tokens == 10
    for kw, needle in (
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"min_p": math.nan}, "min_p must be in [0, 1]"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 11, "max_tokens": 10}, "min_tokens (11) must not exceed max_tokens (10"),
        ({"min_tokens": 33}, "the default max_tokens"),  # the server default is 32
        ({"stop_token_ids": (3, -1)}, "stop_token_ids must be >= 0"),  # gRPC's int32 can be negative
        ({"stop_token_ids": tuple(range(257))}, "at most 256 stop_token_ids"),
    ):
        with pytest.raises(InvalidRequest) as err:
            validator.validate(_req(**kw))
        assert needle in str(err.value), (kw, str(err.value))
        assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_grammar_fallback_default_and_per_request(bpe_tokenizer, info, checker) -> None:
    """--grammar-fallback is what a request that does not say gets; ``checked`` overrides it either way."""
    unique = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(UNIQUE))
    fallback = {
        mode: RequestValidator(bpe_tokenizer, info, checker, ServingDefaults(max_tokens=32, k=4, grammar_fallback=mode))
        for mode in GrammarFallback
    }
    assert ServingDefaults(max_tokens=1, k=1).grammar_fallback is GrammarFallback.CHECKED  # safe by default
    served = fallback[GrammarFallback.CHECKED].validate_request(_req(grammar=unique, temperature=1.0))
    assert (served.grammar.enforcement, served.seq.grammar.checked, served.max_attempts) == ("checked", True, 4)
    with pytest.raises(InvalidRequest, match="uniqueItems") as exc:
        fallback[GrammarFallback.REFUSE].validate(_req(grammar=unique, temperature=1.0))
    assert "checked mode" in exc.value.message  # the refusal says what would serve it
    for mode, v in fallback.items():
        opted = v.validate_request(dataclasses.replace(_req(grammar=unique, temperature=1.0), checked=True))
        assert opted.grammar.enforcement == "checked", mode
        with pytest.raises(InvalidRequest, match="uniqueItems"):
            v.validate(dataclasses.replace(_req(grammar=unique, temperature=1.0), checked=False))
        # An exactly enforceable schema is exact whatever the setting, and max_attempts stays 1.
        exact = v.validate_request(_req(grammar=SCHEMA, temperature=1.0))
        assert (exact.grammar.enforcement, exact.max_attempts) == ("exact", 1), mode
        # Grammars other than JSON Schema have no relaxation: the setting leaves them alone.
        regex = v.validate_request(_req(grammar=GrammarSpec(GrammarKind.REGEX, "[a-z]+")))
        assert regex.seq.grammar.checked is False and regex.grammar.enforcement == "exact"
    # max_attempts without saying checked: allowed where the server falls back to checked mode.
    req = dataclasses.replace(_req(grammar=unique, temperature=1.0), max_attempts=3)
    assert fallback[GrammarFallback.CHECKED].validate_request(req).max_attempts == 3
    with pytest.raises(InvalidRequest, match="checked mode only"):
        fallback[GrammarFallback.REFUSE].validate(req)


def test_unsatisfiable_schema_refused_up_front_in_checked_mode_too(validator) -> None:
    """No value satisfies it (every object matches both oneOf branches), so no attempt could pass
    the end check: refused before any generation, with the reason, whatever the fallback."""
    schema = {
        "type": "object",
        "properties": {
            "d": {"type": "object", "required": ["a", "b"], "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
        },
        "required": ["d"],
    }
    for checked in (None, True, False):
        req = dataclasses.replace(
            _req(grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))), checked=checked
        )
        with pytest.raises(InvalidRequest) as exc:
            validator.validate(req)
        assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "matches nothing" in exc.value.message and "oneOf branches 0 and 1" in exc.value.message, checked
