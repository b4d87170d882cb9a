"""Every vLLM request field is classified, and behaves as its class says (no server needed).

The field walk: the names of vLLM's request models (vllm_request_fields.json, copied from vLLM's
source at a named commit) must each be in ``fields.FIELDS``; each is then sent, with a value
that would change vLLM's output, through parsing and translation as the HTTP routes do:

* SUPPORTED: declared on the endpoint's request model (so it is parsed and translated), or a
  400 naming it where this endpoint or build does not honour it; never ignored;
* REFUSED: a 400 whose ``param`` names the field; its neutral values pass, changing nothing;
* NO_EFFECT: accepted, and the engine request is the one without the field.

A vLLM release that adds a field fails here until the field is classified.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from specmask.common.grammar_spec import GrammarKind
from specmask.orchestrator.api.http import fields, translate
from specmask.orchestrator.api.http.errors import ApiError
from specmask.orchestrator.api.http.fields import FIELDS, STRUCTURED_OUTPUTS, Support
from specmask.orchestrator.api.http.prompting import TranscriptPrompter, load_prompter
from specmask.orchestrator.api.http.protocol import ChatCompletionRequest, CompletionRequest, StructuredOutputs
from tests.fixtures.tokenizers import build_bpe_tokenizer

VLLM = json.loads((Path(__file__).parent / "vllm_request_fields.json").read_text())
DOCS = Path(__file__).parents[4] / "docs" / "openai-api.md"
PROMPTER = TranscriptPrompter()
BASE = {
    "chat_completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "completions": {"model": "m", "prompt": "hi"},
}
MODELS = {"chat_completions": ChatCompletionRequest, "completions": CompletionRequest}
# Values that change vLLM's output (or response), for the walk; other fields get OTHER_VALUE.
CHANGING: dict[str, Any] = {
    "n": 2,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "logit_bias": {"7": 5.0},
    "echo": True,
    "suffix": "tail",
    "best_of": 2,
    "use_beam_search": True,
    "repetition_penalty": 1.3,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 8,
    "prompt_logprobs": 1,
    "allowed_token_ids": [1, 2],
    "bad_words": ["no"],
    "add_generation_prompt": False,
    "continue_final_message": True,
    "add_special_tokens": False,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "priority": 3,
    "logits_processors": ["m.P"],
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "max_repetition_pattern_size": 4,
    "min_repetition_pattern_size": 2,
    "repetition_min_count": 3,
    "prompt_embeds": "AAAA",
    "guided_whitespace_pattern": " ",
    "metadata": {"k": "v"},
    "store": True,
    "service_tier": "flex",
    "user": "u1",
    "include_reasoning": False,
    "length_penalty": 2.0,
}
OTHER_VALUE = {"x": 1}


def translated(endpoint: str, extra: dict[str, Any]) -> translate.Translated:
    """Parse (strictly, as the routes do) and translate one body."""
    body = MODELS[endpoint].model_validate({**BASE[endpoint], **extra}, strict=True)
    if isinstance(body, ChatCompletionRequest):
        return translate.chat_request(body, "rid", PROMPTER)
    return translate.completion_request(body, "rid")


def refused_param(endpoint: str, extra: dict[str, Any]) -> str | None:
    """The ``param`` of the 400 this body gets (parse or translation); None if accepted."""
    try:
        translated(endpoint, extra)
    except ApiError as exc:
        return exc.param
    except ValidationError as exc:
        return ".".join(str(p) for p in exc.errors()[0]["loc"])
    return None


def test_every_vllm_request_field_is_classified() -> None:
    names = set(VLLM["chat_completions"]) | set(VLLM["completions"]) | set(VLLM["older_fields"])
    assert sorted(names - set(FIELDS)) == []
    assert set(VLLM["structured_outputs"]) == set(STRUCTURED_OUTPUTS)
    declared = {f.alias or name for name, f in StructuredOutputs.model_fields.items()}
    assert declared == set(STRUCTURED_OUTPUTS)


WALK = [(endpoint, name) for endpoint in ("chat_completions", "completions") for name in VLLM[endpoint]] + [
    (endpoint, name) for endpoint in ("chat_completions", "completions") for name in VLLM["older_fields"]
]


@pytest.mark.parametrize(("endpoint", "name"), WALK)
def test_field_walk(endpoint: str, name: str) -> None:
    rule = FIELDS[name]
    model = MODELS[endpoint]
    if rule.support is Support.SUPPORTED:
        if name not in model.model_fields:  # never parsed on this endpoint: then never ignored either
            assert refused_param(endpoint, {name: CHANGING.get(name, 1)}) == name
        return
    value = CHANGING.get(name, OTHER_VALUE)
    if rule.support is Support.REFUSED:
        assert refused_param(endpoint, {name: value}) == name
        for neutral in rule.neutral:
            assert translated(endpoint, {name: neutral}).request == translated(endpoint, {}).request
        return
    assert translated(endpoint, {name: value}).request == translated(endpoint, {}).request


def test_supported_fields_are_declared_where_vllm_has_them() -> None:
    """Every SUPPORTED vLLM field is parsed on each endpoint vLLM has it on."""
    for endpoint, model in MODELS.items():
        missing = {n for n in VLLM[endpoint] if FIELDS[n].support is Support.SUPPORTED and n not in model.model_fields}
        assert missing == set(), endpoint


def test_docs_table_is_the_code_table() -> None:
    docs = DOCS.read_text()
    assert fields.markdown_table(FIELDS) in docs
    assert fields.markdown_table(STRUCTURED_OUTPUTS) in docs


def test_unknown_fields_still_pass() -> None:
    base = translated("chat_completions", {}).request
    assert translated("chat_completions", {"prompt_cache_key": "k", "safety_identifier": "s"}).request == base


# ---- structured_outputs ------------------------------------------------------


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("so", "kind", "text"),
    [
        ({"json": SCHEMA}, GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        ({"json": json.dumps(SCHEMA)}, GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        ({"regex": "[a-z]{3}"}, GrammarKind.REGEX, "[a-z]{3}"),
        ({"choice": ["red", "green", "red"]}, GrammarKind.EBNF, 'root ::= "red" | "green"'),
        ({"grammar": 'root ::= "a" | "b"'}, GrammarKind.EBNF, 'root ::= "a" | "b"'),
        ({"grammar": 'start: "a" | "b"'}, GrammarKind.LARK, 'start: "a" | "b"'),
        ({"grammar": '// a comment with ::= in it\nstart: "a"'}, GrammarKind.LARK, None),
        ({"json_object": True}, GrammarKind.JSON_SCHEMA, '{"type": "object"}'),
        ({"json": SCHEMA, "disable_any_whitespace": True}, GrammarKind.JSON_SCHEMA, None),
        ({"json": SCHEMA, "disable_additional_properties": True}, GrammarKind.JSON_SCHEMA, None),
    ],
)
@pytest.mark.parametrize("endpoint", ["chat_completions", "completions"])
def test_structured_outputs_become_grammars(
    endpoint: str, so: dict[str, Any], kind: GrammarKind, text: str | None
) -> None:
    spec = translated(endpoint, {"structured_outputs": so}).request.grammar
    assert spec is not None and spec.kind is kind
    if text is not None:
        assert spec.text == text
    if kind is GrammarKind.JSON_SCHEMA:
        assert spec.strict and not spec.any_whitespace  # what the two options ask, always


@pytest.mark.parametrize(
    ("so", "param"),
    [
        ({}, "structured_outputs"),
        ({"json": SCHEMA, "regex": "a"}, "structured_outputs.regex"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", ""]}, "structured_outputs.choice"),
        ({"json_object": False}, "structured_outputs.json_object"),
        ({"structural_tag": '{"type": "structural_tag"}'}, "structured_outputs.structural_tag"),
        ({"json": SCHEMA, "whitespace_pattern": "[ ]?"}, "structured_outputs.whitespace_pattern"),
        ({"regex": "a", "disable_fallback": True}, "structured_outputs.disable_fallback"),
        ({"choice": "red"}, "structured_outputs.choice"),
    ],
)
def test_structured_outputs_refusals_name_the_field(so: dict[str, Any], param: str) -> None:
    assert refused_param("chat_completions", {"structured_outputs": so}) == param


def test_structured_outputs_is_one_constraint_among_all() -> None:
    both = {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}
    assert refused_param("chat_completions", both) == "structured_outputs"
    assert refused_param("completions", {"structured_outputs": {"regex": "a"}, "guided_regex": "b"}) == (
        "structured_outputs"
    )
    # The engine options apply to it as to guided_*.
    request = translated(
        "chat_completions",
        {"structured_outputs": {"regex": "a+"}, "guided_decoding_backend": "guidance", "guided_checked": True},
    ).request
    spec = request.grammar
    assert spec is not None and spec.backend == "llguidance" and request.checked is True


def test_json_object_chat_gets_no_schema_instruction() -> None:
    prompt = translated("chat_completions", {"structured_outputs": {"json_object": True}}).request.prompt
    assert getattr(prompt, "schema_instruction", None) == ""


# ---- stop_token_ids, include_stop_str_in_output -------------------------------


def test_stop_fields_reach_the_sampling_options() -> None:
    sampling = translated(
        "completions", {"stop_token_ids": [5, 9, 5], "include_stop_str_in_output": True, "stop": "END"}
    ).request.sampling
    assert sampling.stop_token_ids == (5, 9) and sampling.include_stop_str_in_output and sampling.stop == ("END",)
    assert translated("completions", {}).request.sampling.stop_token_ids == ()
    assert refused_param("completions", {"stop_token_ids": [-1]}) == "stop_token_ids"
    assert refused_param("completions", {"stop_token_ids": list(range(translate.MAX_STOP_TOKEN_IDS + 1))}) == (
        "stop_token_ids"
    )
    assert refused_param("completions", {"stop_token_ids": ["5"]}) is not None  # strictly typed


# ---- chat_template_kwargs ------------------------------------------------------


def _template_dir(tmp_path: Path, template: str) -> str:
    out = build_bpe_tokenizer(tmp_path / "tok")
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(chat_template=template, eos_token="</s>")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


def test_chat_template_kwargs_reach_the_template(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
        "{% if reasoning_effort is defined %}<effort={{ reasoning_effort }}>{% endif %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    prompter = load_prompter(_template_dir(tmp_path, template))
    from specmask.orchestrator.chat import ChatRenderer

    renderer = ChatRenderer(prompter)

    def rendered(extra: dict[str, Any], tools: bool = False) -> str:
        body = ChatCompletionRequest.model_validate({**BASE["chat_completions"], **extra}, strict=True)
        prompt = translate.chat_request(body, "rid", prompter).request.prompt
        return prompt if isinstance(prompt, str) else renderer.render(prompt, None)

    assert rendered({}) == "<|user|>hi<|assistant|>"
    assert rendered({"chat_template_kwargs": {"enable_thinking": False}}) == "<|user|>hi<no-think><|assistant|>"
    assert rendered({"reasoning_effort": "low"}) == "<|user|>hi<effort=low><|assistant|>"
    assert rendered({"chat_template_kwargs": {"unread": [1, {"a": 2}]}}) == "<|user|>hi<|assistant|>"
    # Messages with tool results are rendered by the HTTP layer: the variables reach it there too.
    with_tool = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42", "tool_call_id": "c"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert rendered(with_tool) == "<|user|>hi<|tool|>42<no-think><|assistant|>"
    for key in ("add_generation_prompt", "tools", "tokenize", "chat_template", "messages"):
        param = refused_param("chat_completions", {"chat_template_kwargs": {key: False}})
        assert param == f"chat_template_kwargs.{key}"
    # Without a template (the transcript fallback) there is nothing for them to change.
    assert refused_param("chat_completions", {"chat_template_kwargs": {"enable_thinking": False}}) is None
    assert refused_param("completions", {"chat_template_kwargs": {"enable_thinking": False}}) == "chat_template_kwargs"
