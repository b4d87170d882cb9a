"""OpenAI bodies -> GenerationRequest: constraints, sampling, refusals (no server needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from specmask.common.grammar_spec import GrammarKind
from specmask.gpu_worker.types import FinishReason
from specmask.orchestrator.api.http import translate
from specmask.orchestrator.api.http.errors import ApiError
from specmask.orchestrator.api.http.prompting import TemplatePrompter, TranscriptPrompter, load_prompter
from specmask.orchestrator.api.http.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, Tool
from specmask.orchestrator.api.http.responses import finish_error
from specmask.orchestrator.api.http.tool_formats import HERMES
from specmask.orchestrator.api.http.tool_grammar import tool_grammar
from specmask.orchestrator.chat import ChatMessage, ChatPrompt
from specmask.orchestrator.output_check import OutputChecker
from tests.fixtures.tokenizers import build_bpe_tokenizer

PROMPTER = TranscriptPrompter()


def chat(**fields: Any) -> translate.Translated:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return translate.chat_request(ChatCompletionRequest.model_validate(body), "rid", PROMPTER)


def test_defaults_follow_openai() -> None:
    req = chat().request
    assert req.grammar is None and req.sampling.temperature == 1.0 and req.sampling.max_tokens is None
    # A plain chat is rendered by the engine's validator, like a gRPC chat request.
    assert req.prompt == ChatPrompt(messages=(ChatMessage(role="user", content="hi"),))
    tool_result = chat(messages=[{"role": "tool", "content": "42", "tool_call_id": "c1"}]).request
    assert tool_result.prompt == "tool: 42\nassistant:"  # carries tool data: rendered here
    req = chat(max_completion_tokens=7, stop="END", seed=3, top_k=5, temperature=0).request
    assert (req.sampling.max_tokens, req.sampling.stop, req.sampling.seed, req.sampling.top_k) == (7, ("END",), 3, 5)
    assert req.sampling.temperature == 0.0


def test_response_formats_become_json_grammars() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).request.grammar
    assert spec.kind is GrammarKind.JSON_SCHEMA and json.loads(spec.text) == schema
    spec = chat(response_format={"type": "json_object"}).request.grammar
    assert json.loads(spec.text) == {"type": "object"}
    assert chat(response_format={"type": "text"}).request.grammar is None


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("guided_regex", "[a-z]+", GrammarKind.REGEX),
        ("guided_grammar", 'root ::= "a"', GrammarKind.EBNF),
        ("guided_lark", 'start: "a"', GrammarKind.LARK),
        ("guided_json", {"type": "string"}, GrammarKind.JSON_SCHEMA),
    ],
)
def test_guided_extensions(field: str, value: Any, kind: GrammarKind) -> None:
    assert chat(**{field: value}).request.grammar.kind is kind


def test_guided_choice_is_an_escaped_alternation() -> None:
    spec = chat(guided_choice=["a", 'b "q"', "a"]).request.grammar
    assert spec.kind is GrammarKind.EBNF and spec.text == 'root ::= "a" | "b \\"q\\""'


def test_speculation_extension() -> None:
    req = chat(speculation={"k": 2, "proposers": ["ngram"], "draft_masking": False}).request
    assert (req.speculation.k, req.speculation.proposers, req.speculation.draft_masking) == (2, ("ngram",), False)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"1": 2.0}}, "logit_bias"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)
def test_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as exc:
        chat(**fields)
    assert exc.value.status == 400 and exc.value.param == param and exc.value.message


def test_logprobs_fields_map_to_the_engines_alternatives() -> None:
    assert chat().request.sampling.logprobs is None
    assert chat(logprobs=False).request.sampling.logprobs is None
    assert chat(logprobs=False, top_logprobs=0).request.sampling.logprobs is None  # neutral values pass
    assert chat(logprobs=True).request.sampling.logprobs == 0
    assert chat(logprobs=True, top_logprobs=20).request.sampling.logprobs == 20

    def completion(**fields: Any) -> translate.Translated:
        body = CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})
        return translate.completion_request(body, "r")

    assert completion().request.sampling.logprobs is None
    assert completion(logprobs=0).request.sampling.logprobs == 0
    assert completion(logprobs=5).request.sampling.logprobs == 5
    for bad in (6, -1):
        with pytest.raises(ApiError) as exc:
            completion(logprobs=bad)
        assert exc.value.status == 400 and exc.value.param == "logprobs"


def test_completion_prompts() -> None:
    def completion(prompt: Any) -> translate.Translated:
        return translate.completion_request(CompletionRequest.model_validate({"model": "m", "prompt": prompt}), "r")

    assert completion("x").request.prompt == "x"
    assert completion([1, 2, 3]).request.prompt == (1, 2, 3)
    assert completion(["only"]).request.prompt == "only"
    with pytest.raises(ApiError, match="one prompt"):
        completion(["a", "b"])


# ---- tools ------------------------------------------------------------------

POINT = {
    "type": "object",
    "properties": {"p": {"$ref": "#/$defs/pt"}},
    "required": ["p"],
    "$defs": {"pt": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}},
}
TOOLS = [
    Tool.model_validate({"type": "function", "function": {"name": "move", "parameters": POINT}}),
    Tool.model_validate({"type": "function", "function": {"name": "stop"}}),
]


def test_tool_choice_grammars_accept_exactly_valid_calls() -> None:
    """ "required": one or more calls to any tool; named: one call to that tool (Hermes here, the
    format of a model without a template); each tool's own $defs resolve inside its arguments."""
    checker = OutputChecker()

    def call(name: str, arguments: object) -> str:
        return HERMES.call_head(name) + json.dumps(arguments) + HERMES.tail

    required = tool_grammar(TOOLS, "required", parallel=True).grammar
    assert checker.check(required, call("move", {"p": [1, 2]})).ok
    assert checker.check(required, call("stop", {}) + "\n" + call("move", {"p": [3, 4]})).ok
    assert not checker.check(required, call("move", {"p": [1]})).ok
    assert not checker.check(required, call("jump", {})).ok
    assert not checker.check(required, "plain text").ok
    named = tool_grammar(
        TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "stop"}}), True
    )
    assert checker.check(named.grammar, call("stop", {})).ok and named.max_calls == 1
    assert not checker.check(named.grammar, call("move", {"p": [1, 2]})).ok
    assert not checker.check(named.grammar, call("stop", {}) + "\n" + call("stop", {})).ok


def test_tool_choice_refusals() -> None:
    with pytest.raises(ApiError, match="not in tools"):
        tool_grammar(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "x"}}), True)
    remote = Tool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": {"$ref": "https://example.com/s.json"}}}
    )
    with pytest.raises(ApiError) as exc:
        tool_grammar([remote], "required", parallel=True)
    assert exc.value.param == "tools"


# ---- prompts and finish reasons ---------------------------------------------


def _template_dir(tmp_path, template: str) -> str:
    """A real tokenizer directory (tokenizer.json + tokenizer_config.json) carrying ``template``."""
    out = build_bpe_tokenizer(tmp_path / "tok")
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(chat_template=template, eos_token="</s>")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


def test_chat_template_renders_and_refusals_are_400(tmp_path) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    prompter = load_prompter(_template_dir(tmp_path, template))
    assert isinstance(prompter, TemplatePrompter) and not prompter.supports_tools
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    )
    assert prompter.render(body.messages, None) == "<|system|>s</s><|user|>u</s><|assistant|>"
    tool_msg = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "tool", "content": "r", "tool_call_id": "c"}]}
    )
    with pytest.raises(ApiError, match="no tools here"):
        prompter.render(tool_msg.messages, None)
    assert isinstance(load_prompter(str(tmp_path / "missing")), TranscriptPrompter)


def test_chat_template_is_rendered_by_transformers_with_tools(tmp_path) -> None:
    # Globals only Hugging Face's renderer provides (strftime_now), tools as the template reads them.
    template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }}{{ t.function.parameters | tojson }}"
        "{% endfor %}\n{% endif %}{{ strftime_now('%Y') | length }}|"
        "{% for m in messages %}{{ m.role }}={{ m.content }}{% if m.tool_calls %}"
        "{% for c in m.tool_calls %}[{{ c.function.name }}({{ c.function.arguments.city }})]{% endfor %}"
        "{% endif %};{% endfor %}{% if add_generation_prompt %}assistant={% endif %}"
    )
    prompter = load_prompter(_template_dir(tmp_path, template))
    assert prompter.supports_tools
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "Wetter in Zürich?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Zürich"}'}}
                    ],
                },
                {"role": "tool", "content": "12°C", "tool_call_id": "c1"},
            ],
            "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
        }
    )
    text = prompter.render(body.messages, body.tools)
    assert text == ('TOOLS:w{"type": "object"}4|user=Wetter in Zürich?;assistant=[w(Zürich)];tool=12°C;assistant=')


def test_a_template_whose_tokenizer_does_not_load_fails_at_start(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    with pytest.raises(RuntimeError, match="tokenizer does not load"):
        load_prompter(str(tmp_path))


def test_smollm2_template_matches_apply_chat_template(smollm2_dir) -> None:
    # The served model's own template, against transformers called directly.
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Antworte kurz."}, {"role": "user", "content": "Hallo 👋"}]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    expected = AutoTokenizer.from_pretrained(str(smollm2_dir)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert load_prompter(str(smollm2_dir)).render(body.messages, None) == expected


def test_only_successful_finishes_are_successes() -> None:
    for reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.GRAMMAR_COMPLETE):
        assert finish_error(reason, None) is None
    # Every other reason (errors, shutdown cancels, grammar violations found at the end) is an error.
    for reason in set(FinishReason) - {FinishReason.STOP, FinishReason.LENGTH, FinishReason.GRAMMAR_COMPLETE}:
        error = finish_error(reason, "why")
        assert error is not None and error.status >= 500


def test_min_tokens_its_grammar_forbids_is_the_callers_error() -> None:
    from specmask.gpu_worker.types import MIN_TOKENS_UNREACHABLE, ErrorKind

    error = finish_error(
        FinishReason.ERROR,
        f"{MIN_TOKENS_UNREACHABLE}: the grammar ends at token 3 of 8",
        ErrorKind.MIN_TOKENS_UNREACHABLE,
    )
    assert error is not None and error.status == 400 and error.param == "min_tokens"


@pytest.mark.parametrize("text", ["", "plain", 'quote " and \\ slash', "ünïcödé \u2028 \n\t", "\x00\x1f"])
def test_delta_encoder_matches_full_serialisation(text: str) -> None:
    from specmask.orchestrator.api.http import responses
    from specmask.orchestrator.api.http.sse import DeltaEncoder, _encode

    env = responses.Envelope(id="chatcmpl-1", model='m"odel', created=7)
    chat = DeltaEncoder(responses.chat_chunk(env, {"content": DeltaEncoder.PLACEHOLDER}))
    assert chat.encode(text) == _encode(responses.chat_chunk(env, {"content": text}))
    completion = DeltaEncoder(responses.completion_chunk(env, DeltaEncoder.PLACEHOLDER))
    assert completion.encode(text) == _encode(responses.completion_chunk(env, text))


def test_domain_errors_map_to_openai_statuses() -> None:
    from specmask.orchestrator import errors

    cases = [
        (errors.InvalidRequest("bad"), 400, None),
        (errors.GrammarTimeout("slow"), 400, None),
        (errors.DuplicateRequestId("dup"), 409, None),
        (errors.Overloaded("full"), 429, "1"),
        (errors.Unavailable("no worker"), 503, "1"),
        (errors.ShuttingDown("bye"), 503, "1"),
    ]
    for exc, status, retry_after in cases:
        api = ApiError.from_request_error(exc)
        assert api.status == status and api.body()["error"]["message"] == exc.message
        assert api.headers().get("Retry-After") == retry_after


def test_backend_and_checked_mode_extensions() -> None:
    """vLLM-style ``guided_decoding_backend`` plus our ``guided_checked``/``guided_max_attempts``."""
    schema = {"type": "array", "uniqueItems": True}
    req = chat(guided_json=schema, guided_decoding_backend="llguidance", guided_checked=True, guided_max_attempts=3)
    assert (req.request.grammar.backend, req.request.checked, req.request.max_attempts) == ("llguidance", True, 3)
    assert chat(guided_json=schema, guided_checked=False).request.checked is False  # demands exact
    assert chat(guided_json=schema, guided_decoding_backend="guidance").request.grammar.backend == "llguidance"
    assert chat(guided_json=schema, guided_decoding_backend="auto").request.grammar.backend == ""
    plain = chat(guided_json=schema).request
    # Unset: the server's --grammar-fallback decides (validation), not the translation.
    assert (plain.grammar.backend, plain.grammar.checked, plain.checked, plain.max_attempts) == ("", False, None, None)
    with pytest.raises(ApiError) as exc:
        chat(guided_json=schema, guided_decoding_backend="outlines")
    assert exc.value.param == "guided_decoding_backend" and "known: auto, guidance, llguidance, xgrammar" in str(
        exc.value.message
    )
    with pytest.raises(ApiError) as exc:
        chat(guided_checked=True)  # nothing to check
    assert exc.value.param == "guided_checked"
