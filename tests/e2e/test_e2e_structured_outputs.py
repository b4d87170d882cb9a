"""vLLM's ``structured_outputs`` and stop fields through the real ``openai`` SDK (``extra_body``),
the way vLLM's docs show them, against the full stack: every answer obeys its constraint.

Sampled at temperature 1 with a few seeds, so a constraint that was dropped would show up as
text outside it. A finish by ``length`` can only be checked as a prefix; a finish by ``stop`` is
checked whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

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


@pytest.fixture(scope="module")
def client(stack: ThreadStack) -> Iterator[openai.OpenAI]:
    assert stack.running is not None and stack.running.server.http_port
    base_url = f"http://127.0.0.1:{stack.running.server.http_port}/v1"
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat(client: openai.OpenAI, model: str, seed: int, extra: dict[str, Any], max_tokens: int = 48) -> Any:
    resp = client.chat.completions.create(
        model=model, messages=ASK, temperature=1.0, seed=seed, max_tokens=max_tokens, extra_body=extra
    )
    return resp.choices[0]


def test_choice(client: openai.OpenAI, model: str) -> None:
    for seed in SEEDS:
        choice = _chat(client, model, seed, {"structured_outputs": {"choice": ["red", "green"]}})
        assert choice.finish_reason == "stop" and choice.message.content in ("red", "green")


def test_json(client: openai.OpenAI, model: str) -> None:
    for seed in SEEDS:
        choice = _chat(client, model, seed, {"structured_outputs": {"json": SCHEMA}}, max_tokens=64)
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_regex(client: openai.OpenAI, model: str) -> None:
    pattern = r"(yes|no)-[0-9]{2}"
    for seed in SEEDS:
        choice = _chat(client, model, seed, {"structured_outputs": {"regex": pattern}})
        assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.message.content)


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "sky is " colour\ncolour ::= "blue" | "grey"',  # EBNF
        'start: "sky is " colour\ncolour: "blue" | "grey"',  # Lark
    ],
)
def test_grammar(client: openai.OpenAI, model: str, grammar: str) -> None:
    for seed in SEEDS:
        choice = _chat(client, model, seed, {"structured_outputs": {"grammar": grammar}})
        assert choice.finish_reason == "stop" and choice.message.content in ("sky is blue", "sky is grey")


def test_json_object(client: openai.OpenAI, model: str) -> None:
    for seed in SEEDS:
        choice = _chat(client, model, seed, {"structured_outputs": {"json_object": True}}, max_tokens=64)
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_completions_take_structured_outputs_too(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(
        model=model,
        prompt="Colour:",
        temperature=1.0,
        seed=4,
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    )
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].text in ("red", "green")


def test_what_cannot_be_honoured_is_a_400_naming_it(client: openai.OpenAI, model: str) -> None:
    cases = [
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"regex": "a", "unheard_of": 1}}, "structured_outputs.unheard_of"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"bad_words": ["red"]}, "bad_words"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            _chat(client, model, 1, extra, max_tokens=4)
        assert exc.value.body["param"] == param, exc.value.body
    # Neutral values change nothing and pass.
    neutral = {"repetition_penalty": 1.0, "skip_special_tokens": True, "bad_words": [], "n": 1}
    assert _chat(client, model, 1, neutral, max_tokens=2).finish_reason in ("stop", "length")


def test_stop_token_ids(client: openai.OpenAI, model: str, tiny_pair: tuple[Path, Path]) -> None:
    """Greedy, with a later token of the output as a stop token: the output ends there, without
    its text, or with it under include_stop_str_in_output."""
    from tokenizers import Tokenizer

    resp = client.completions.create(
        model=model, prompt="Once upon", temperature=0.0, max_tokens=16, logprobs=0, extra_body={"ignore_eos": True}
    )
    full = resp.choices[0]
    tokens, offsets = full.logprobs.tokens, full.logprobs.text_offset
    # The first token (after the first) with whole characters whose text no earlier token has.
    at = next(
        (i for i in range(1, len(tokens) - 1) if tokens[i] and "\\x" not in tokens[i] and tokens[i] not in tokens[:i]),
        None,
    )
    if at is None:
        pytest.skip("the greedy output has no token told apart from the earlier ones by its text")
    tokenizer = Tokenizer.from_file(str(tiny_pair[0] / "tokenizer.json"))
    # Every id with that text (the greedy token is one): none of them is among the earlier tokens.
    stop_ids = [i for i in range(tokenizer.get_vocab_size()) if tokenizer.decode([i]) == tokens[at]]
    assert stop_ids
    for include in (False, True):
        resp = client.completions.create(
            model=model,
            prompt="Once upon",
            temperature=0.0,
            max_tokens=16,
            extra_body={"ignore_eos": True, "stop_token_ids": stop_ids, "include_stop_str_in_output": include},
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "stop" and resp.usage.completion_tokens == at + 1
        end = offsets[at + 1] if include else offsets[at]
        assert choice.text == full.text[:end]
