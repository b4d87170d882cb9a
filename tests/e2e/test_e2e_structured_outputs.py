"""vLLM's ``structured_outputs`` and stop fields through the real ``openai`` SDK (``extra_body``),
the way vLLM's docs show them, against the full stack: every answer obeys its constraint.

Sampled at temperature 1 with a few seeds, so a constraint that was dropped would show up as
text outside it. A finish by ``length`` can only be checked as a prefix; a finish by ``stop`` is
checked whole.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import ThreadStack

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What colour is the sky?"}]
SEEDS = (1, 2, 3)


def _chat(openai_client: openai.OpenAI, model: str, seed: int, extra: dict[str, Any], max_tokens: int = 48) -> Any:
    resp = openai_client.chat.completions.create(
        model=model, messages=ASK, temperature=1.0, seed=seed, max_tokens=max_tokens, extra_body=extra
    )
    return resp.choices[0]


def test_choice(openai_client: openai.OpenAI, model: str) -> None:
    for seed in SEEDS:
        choice = _chat(openai_client, model, seed, {"structured_outputs": {"choice": ["red", "green"]}})
        assert choice.finish_reason == "stop" and choice.message.content in ("red", "green")


def test_json(openai_client: openai.OpenAI, model: str) -> None:
    for seed in SEEDS:
        choice = _chat(openai_client, model, seed, {"structured_outputs": {"json": SCHEMA}}, max_tokens=64)
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_regex(openai_client: openai.OpenAI, model: str) -> None:
    pattern = r"(yes|no)-[0-9]{2}"
    for seed in SEEDS:
        choice = _chat(openai_client, model, seed, {"structured_outputs": {"regex": pattern}})
        assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.message.content)


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "sky is " colour\ncolour ::= "blue" | "grey"',  # EBNF
        'start: "sky is " colour\ncolour: "blue" | "grey"',  # Lark
    ],
)
def test_grammar(openai_client: openai.OpenAI, model: str, grammar: str) -> None:
    for seed in SEEDS:
        choice = _chat(openai_client, model, seed, {"structured_outputs": {"grammar": grammar}})
        assert choice.finish_reason == "stop" and choice.message.content in ("sky is blue", "sky is grey")


def test_json_object(openai_client: openai.OpenAI, model: str) -> None:
    for seed in SEEDS:
        choice = _chat(openai_client, model, seed, {"structured_outputs": {"json_object": True}}, max_tokens=64)
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_completions_take_structured_outputs_too(openai_client: openai.OpenAI, model: str) -> None:
    resp = openai_client.completions.create(
        model=model,
        prompt="Colour:",
        temperature=1.0,
        seed=4,
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    )
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].text in ("red", "green")


def test_what_cannot_be_honoured_is_a_400_naming_it(openai_client: openai.OpenAI, model: str) -> None:
    cases = [
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"regex": "a", "unheard_of": 1}}, "structured_outputs.unheard_of"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"bad_words": ["red"]}, "bad_words"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            _chat(openai_client, model, 1, extra, max_tokens=4)
        assert exc.value.body["param"] == param, exc.value.body
    # Neutral values change nothing and pass.
    neutral = {"repetition_penalty": 1.0, "skip_special_tokens": True, "bad_words": [], "n": 1}
    assert _chat(openai_client, model, 1, neutral, max_tokens=2).finish_reason in ("stop", "length")


# Stop tokens and min_tokens' stop-string floor, against a seeded reference output: at a high
# temperature the random-init model samples varied tokens (its greedy output repeats one token),
# and a stop token or stop string changes nothing before the point where it ends the output, so
# each answer must be an exact prefix of the reference. Without speculation: the worker's
# speculation gate chooses drafting by measured speed, and a step's randomness is keyed by the
# step, so a speculative seeded output differs from run to run.
STOP_PROMPT = "Once upon"
STOP_SEED = 11
STOP_TEMPERATURE = 3.0
STOP_MAX_TOKENS = 24
STOP_REGEX = "[a-z ]{1,40}"


@pytest.fixture(scope="module")
def tokenizer(tiny_pair: tuple[Path, Path]) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_pair[0] / "tokenizer.json"))


def _grpc_sampled(stack: ThreadStack, regex: str | None = None, **sampling: Any) -> pb.GenerateResponse:
    req = build_request(
        STOP_PROMPT,
        regex=regex,
        temperature=STOP_TEMPERATURE,
        seed=STOP_SEED,
        max_tokens=STOP_MAX_TOKENS,
        ignore_eos=regex is None,
        speculation=False,
    )
    for name, value in sampling.items():
        if name == "stop_token_ids":
            req.sampling.stop_token_ids.extend(value)
        elif name == "stop":
            req.sampling.stop.extend(value)
        else:
            setattr(req.sampling, name, value)
    with OrchestratorClient(stack.address) as c:
        return c.generate(req, timeout_s=300)


def _first_clean_new_token(ids: list[int], text: str, tokenizer: Any) -> int:
    """The latest position whose token appears there for the first time, with no character split
    before or after it (so the reference's text before and through it is the decoded ids')."""
    eos = tokenizer.token_to_id("<|eos|>")
    candidates = [
        f
        for f in range(1, len(ids))
        if ids[f] != eos
        and ids[f] not in ids[:f]
        and text.startswith(tokenizer.decode(ids[:f]))
        and text.startswith(tokenizer.decode(ids[: f + 1]))
    ]
    assert candidates, f"the seeded reference has no new token after the first: {ids} {text!r}"
    return candidates[-1]


@pytest.mark.parametrize("regex", [None, STOP_REGEX], ids=["unconstrained", "regex"])
def test_stop_token_ids_end_a_seeded_output_at_the_tokens_first_occurrence(
    stack: ThreadStack, openai_client: openai.OpenAI, model: str, tokenizer: Any, regex: str | None
) -> None:
    """Over gRPC and HTTP: the output is the reference's tokens through the stop token's first
    occurrence (usage counts it), its text the reference's before the token, and with
    include_stop_str_in_output through it."""
    ref = _grpc_sampled(stack, regex)
    ids = list(ref.token_ids)
    f = _first_clean_new_token(ids, ref.text, tokenizer)
    before, through = tokenizer.decode(ids[:f]), tokenizer.decode(ids[: f + 1])
    assert ref.text.startswith(through)
    for include in (False, True):
        want = through if include else before
        got = _grpc_sampled(stack, regex, stop_token_ids=[ids[f]], include_stop_str_in_output=include)
        assert got.finish_reason == pb.FINISH_REASON_STOP, got
        assert list(got.token_ids) == ids[: f + 1] and got.usage.completion_tokens == f + 1
        assert got.text == want, (include, got.text, want)
        extra: dict[str, Any] = {
            "stop_token_ids": [ids[f]],
            "include_stop_str_in_output": include,
            "speculation": {"enabled": False},
        }
        if regex is None:
            extra["ignore_eos"] = True
        else:
            extra["structured_outputs"] = {"regex": regex}
        resp = openai_client.completions.create(
            model=model,
            prompt=STOP_PROMPT,
            temperature=STOP_TEMPERATURE,
            seed=STOP_SEED,
            max_tokens=STOP_MAX_TOKENS,
            extra_body=extra,
        )
        assert resp.choices[0].finish_reason == "stop" and resp.usage.completion_tokens == f + 1
        assert resp.choices[0].text == want, (include, resp.choices[0].text, want)
        if regex is not None:
            assert re.fullmatch(regex, want)
    # The stop token as the last token max_tokens allows: the stop ended the output, not the length.
    got = _grpc_sampled(stack, regex, stop_token_ids=[ids[f]], max_tokens=f + 1)
    assert (got.finish_reason, got.text, list(got.token_ids)) == (pb.FINISH_REASON_STOP, before, ids[: f + 1])


def test_min_tokens_lets_only_a_stop_string_ending_after_them_stop(
    stack: ThreadStack, openai_client: openai.OpenAI, model: str, tokenizer: Any
) -> None:
    """vLLM's rule, over gRPC and HTTP: with min_tokens m, a stop-string occurrence ends the
    output only if it ends in the text of a token after the m-th. The stop string is a character
    the reference repeats; m puts its first occurrence inside the floor, so the output runs on
    to a later one."""
    ref = _grpc_sampled(stack)
    ids, text = list(ref.token_ids), ref.text
    prefixes = [tokenizer.decode(ids[:m]) for m in range(len(ids) + 1)]
    cases = []
    for stop in sorted({c for c in text if c.isascii() and c.isalnum() and text.count(c) >= 2}):
        first = text.index(stop)
        # The fewest tokens whose whole-character text covers the first occurrence.
        m = next(m for m, p in enumerate(prefixes) if len(p) > first and text.startswith(p))
        if m < len(ids):
            cases.append((stop, m))
    assert cases, f"the seeded reference repeats no character: {text!r}"
    for stop, m in cases[:3]:
        floor = len(prefixes[m])
        later = [i for i in range(len(text)) if text.startswith(stop, i) and i + len(stop) > floor]
        want, reason = (text[: later[0]], "stop") if later else (text, "length")
        got = _grpc_sampled(stack, stop=[stop], min_tokens=m)
        assert (got.text, got.finish_reason) == (want, pb.FinishReason.Value(f"FINISH_REASON_{reason.upper()}"))
        assert _grpc_sampled(stack, stop=[stop]).text == text[: text.index(stop)]  # no floor: the first one
        resp = openai_client.completions.create(
            model=model,
            prompt=STOP_PROMPT,
            temperature=STOP_TEMPERATURE,
            seed=STOP_SEED,
            max_tokens=STOP_MAX_TOKENS,
            stop=[stop],
            extra_body={"ignore_eos": True, "min_tokens": m, "speculation": {"enabled": False}},
        )
        assert (resp.choices[0].text, resp.choices[0].finish_reason) == (want, reason), (stop, m)
