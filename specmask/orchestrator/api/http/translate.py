"""OpenAI request bodies -> the engine's ``GenerationRequest`` (the same one gRPC builds).

Refusals here are ``ApiError`` (400) with the offending field in ``param``.
Semantic checks of values (ranges, context length, the grammar itself) are
left to the engine's validator, exactly as for gRPC, so both APIs accept and
refuse the same things with the same messages.

Defaults that differ from the gRPC API, to match OpenAI: an omitted
``temperature`` is 1.0 (gRPC: greedy). Structured output has exactly one
source per request: ``response_format`` (json_schema / json_object), a tool
call (``tools`` + ``tool_choice``), vLLM's ``structured_outputs``, or one
``guided_*`` extension field. Which vLLM fields are honoured, refused or
accepted without effect is ``fields.FIELDS``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.orchestrator.api.http import fields
from specmask.orchestrator.api.http.errors import ApiError
from specmask.orchestrator.api.http.prompting import ChatPrompter
from specmask.orchestrator.api.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    StructuredOutputs,
    _Generation,
)
from specmask.orchestrator.api.http.tool_grammar import ToolGrammar, tool_grammar, tools_prompt, with_system_text
from specmask.orchestrator.chat import RESERVED_TEMPLATE_KWARGS, ChatMessage, ChatPrompt
from specmask.orchestrator.types import GenerationRequest, SamplingOptions, SpeculationOptions
from specmask.orchestrator.validation import MAX_STOP_TOKEN_IDS

OPENAI_DEFAULT_TEMPERATURE = 1.0
# Alternatives per token: chat's top_logprobs (OpenAI: 0..20), the legacy completions' logprobs (0..5).
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# guided_decoding_backend values -> GrammarSpec.backend ("" = the mask service picks). vLLM calls
# llguidance "guidance"; its other backends (outlines, lm-format-enforcer) are not here: a 400.
BACKEND_NAMES = {"auto": "", "xgrammar": "xgrammar", "llguidance": "llguidance", "guidance": "llguidance"}
# A line of an EBNF (GBNF) grammar defines a rule with "::="; Lark's rules use ":".
_EBNF_RULE = re.compile(r"::=")
_GRAMMAR_COMMENT = re.compile(r"(#|//).*$")


@dataclass(frozen=True)
class Translated:
    request: GenerationRequest
    # Tools that may be called: the output is calls (or, with tool_choice "auto", text) in the
    # model's tool-call format, parsed into message.tool_calls (tool_grammar).
    tools: ToolGrammar | None = None


def chat_request(body: ChatCompletionRequest, request_id: str, prompter: ChatPrompter) -> Translated:
    logprobs = _chat_logprobs(body)
    if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
        raise ApiError.invalid("max_tokens and max_completion_tokens disagree; send one", param="max_tokens")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    grammars: list[tuple[str, GrammarSpec]] = []
    calls = None
    if body.tools and body.tool_choice != "none":
        # "auto" (OpenAI's default with tools): text or calls; "required" / named: calls.
        parallel = body.parallel_tool_calls is not False
        calls = tool_grammar(
            body.tools,
            body.tool_choice,
            parallel,
            prompter.tool_format,
            prompter.special_tokens,
            prompter.stop_token_ids,
        )
        grammars.append(("tools", calls.grammar))
    elif body.tool_choice not in (None, "none"):
        raise ApiError.invalid("tool_choice was given without tools", param="tool_choice")
    grammars += _format_grammar(body.response_format)
    grammars += _guided_grammars(body)
    if calls is not None and calls.text_allowed and len(grammars) > 1:
        # "text or a call" leaves no room for a second constraint on the text.
        raise ApiError.invalid(
            f'tools with tool_choice "auto" cannot be combined with {grammars[1][0]}; '
            'use tool_choice "required" or a named function',
            param=grammars[1][0],
        )
    template_kwargs = _template_kwargs(body)
    if calls is not None:
        prompt: str | ChatPrompt = _tools_prompt(body, prompter, template_kwargs)
    else:
        prompt = _chat_prompt(body, prompter, template_kwargs)
    return Translated(
        request=_request(body, request_id, prompt, max_tokens, _one_grammar(grammars, body), logprobs),
        tools=calls,
    )


def _chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """``logprobs: true`` -> the engine's alternatives per token (``top_logprobs``, default 0);
    None when not asked. ``top_logprobs`` > 0 without ``logprobs: true`` is refused, as by OpenAI."""
    top = body.top_logprobs
    if top is not None and not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
        raise ApiError.invalid(f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {top}", param="top_logprobs")
    if not body.logprobs:
        if top:
            raise ApiError.invalid("top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return top or 0


def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The chat template's extra variables: ``chat_template_kwargs`` and ``reasoning_effort``
    (vLLM passes both to the template; a template that reads neither renders as without)."""
    kwargs = dict(body.chat_template_kwargs or {})
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ApiError.invalid(
                f"chat_template_kwargs.{key} is an argument of the template renderer, not a template "
                "variable; it cannot be set per request",
                param=f"chat_template_kwargs.{key}",
            )
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    return kwargs or None


def _tools_prompt(
    body: ChatCompletionRequest, prompter: ChatPrompter, template_kwargs: Mapping[str, Any] | None
) -> str:
    """The conversation with the tools: the chat template renders them when it knows how;
    otherwise a system message lists them and shows the call format the grammar admits."""
    if body.schema_instruction is not None:
        raise ApiError.invalid("schema_instruction applies to plain chats only (no tools)", param="schema_instruction")
    assert body.tools is not None
    if prompter.supports_tools:
        return prompter.render(body.messages, body.tools, template_kwargs)
    text = tools_prompt(body.tools, prompter.tool_format)
    return prompter.render(with_system_text(body.messages, text), None, template_kwargs)


def _chat_prompt(
    body: ChatCompletionRequest, prompter: ChatPrompter, template_kwargs: Mapping[str, Any] | None
) -> str | ChatPrompt:
    """Plain conversations go to the engine as a ``ChatPrompt`` and are rendered by its validator,
    exactly as gRPC chat requests are (off the event loop, with the JSON Schema instruction).
    Conversations carrying tool calls or results are rendered here: the template gets the
    calls, which ``ChatPrompt`` does not carry."""
    plain = all(m.tool_calls is None and m.tool_call_id is None and m.name is None for m in body.messages)
    if plain:
        messages = tuple(ChatMessage(role=m.role, content=m.text) for m in body.messages)
        instruction = body.schema_instruction
        json_mode = (body.response_format is not None and body.response_format.type == "json_object") or (
            body.structured_outputs is not None and body.structured_outputs.json_object is not None
        )
        if instruction is None and json_mode:
            # JSON mode is "any object": an instruction would show the model {"type": "object"} to copy.
            instruction = ""
        return ChatPrompt(
            messages=messages,
            schema_instruction=instruction,
            template_kwargs=dict(template_kwargs) if template_kwargs else None,
        )
    if body.schema_instruction is not None:
        raise ApiError.invalid("schema_instruction applies to plain chats only (no tools)", param="schema_instruction")
    return prompter.render(body.messages, None, template_kwargs)


def completion_request(body: CompletionRequest, request_id: str) -> Translated:
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise ApiError.invalid(
            f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {body.logprobs}", param="logprobs"
        )
    if body.echo:
        raise ApiError.invalid("echo is not supported", param="echo")
    if body.best_of not in (None, 1):
        raise ApiError.invalid("best_of > 1 is not supported", param="best_of")
    if body.suffix:
        raise ApiError.invalid("suffix is not supported", param="suffix")
    prompt: str | tuple[int, ...]
    if isinstance(body.prompt, str):
        prompt = body.prompt
    elif body.prompt and all(isinstance(p, int) for p in body.prompt):
        prompt = tuple(body.prompt)  # type: ignore[arg-type]  # all() above: every item is an int
    elif len(body.prompt) == 1:
        prompt = body.prompt[0]  # type: ignore[assignment]  # one text (a lone int is caught above)
    else:
        raise ApiError.invalid("one prompt per request (a list of prompts is a batch, not supported)", param="prompt")
    grammars = _format_grammar(body.response_format) + _guided_grammars(body)
    grammar = _one_grammar(grammars, body)
    return Translated(request=_request(body, request_id, prompt, body.max_tokens, grammar, body.logprobs))


def _request(
    body: _Generation,
    request_id: str,
    prompt: str | tuple[int, ...] | ChatPrompt,
    max_tokens: int | None,
    grammar: GrammarSpec | None,
    logprobs: int | None = None,
) -> GenerationRequest:
    if body.n is not None and body.n < 1:
        raise ApiError.invalid(f"n must be >= 1, got {body.n}", param="n")
    if body.n not in (None, 1):
        raise ApiError.invalid("n > 1 is not supported: send n=1 (or several requests)", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ApiError.invalid(f"{name} is not supported (only 0)", param=name)
    if body.logit_bias:
        raise ApiError.invalid("logit_bias is not supported", param="logit_bias")
    fields.check_undeclared(body)
    if body.stream_options is not None and not body.stream:
        raise ApiError.invalid("stream_options needs stream=true", param="stream_options")
    stop: tuple[str, ...] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    stop_token_ids = tuple(dict.fromkeys(body.stop_token_ids or ()))
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError.invalid(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids")
    if any(t < 0 for t in stop_token_ids):
        raise ApiError.invalid("stop_token_ids must be >= 0", param="stop_token_ids")
    sampling = SamplingOptions(
        temperature=OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens or 0,
        seed=body.seed,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
    )
    if body.seed is not None and body.seed < 0:
        raise ApiError.invalid("seed must be >= 0", param="seed")
    spec = body.speculation
    speculation = (
        SpeculationOptions()
        if spec is None
        else SpeculationOptions(
            enabled=spec.enabled,
            k=spec.k,
            proposers=tuple(spec.proposers) if spec.proposers is not None else None,
            draft_masking=spec.draft_masking,
        )
    )
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt,
        grammar=grammar,
        sampling=sampling,
        speculation=speculation,
        max_attempts=body.guided_max_attempts,
        checked=body.guided_checked,
    )


def _schema_spec(schema: Any) -> GrammarSpec:
    return GrammarSpec(kind=GrammarKind.JSON_SCHEMA, text=schema if isinstance(schema, str) else json.dumps(schema))


def _format_grammar(fmt: ResponseFormat | None) -> list[tuple[str, GrammarSpec]]:
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise ApiError.invalid('json_schema given with response_format type "text"', param="response_format")
        return []
    if fmt.type == "json_object":
        # OpenAI's JSON mode: a JSON object (not any JSON value).
        return [("response_format", _schema_spec({"type": "object"}))]
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError.invalid(
            'response_format type "json_schema" needs json_schema.schema', param="response_format.json_schema"
        )
    return [("response_format", _schema_spec(fmt.json_schema.schema_))]


def _guided_grammars(body: _Generation) -> list[tuple[str, GrammarSpec]]:
    out: list[tuple[str, GrammarSpec]] = []
    if body.guided_json is not None:
        out.append(("guided_json", _schema_spec(body.guided_json)))
    for name, kind in (
        ("guided_regex", GrammarKind.REGEX),
        ("guided_grammar", GrammarKind.EBNF),
        ("guided_lark", GrammarKind.LARK),
    ):
        text = getattr(body, name)
        if text is not None:
            out.append((name, GrammarSpec(kind=kind, text=text)))
    if body.guided_choice is not None:
        out.append(("guided_choice", _choice_spec(body.guided_choice, "guided_choice")))
    if body.structured_outputs is not None:
        out.append(("structured_outputs", _structured_outputs_spec(body.structured_outputs)))
    return out


def _choice_spec(choices: list[str], param: str) -> GrammarSpec:
    if not choices or not all(choices):
        raise ApiError.invalid(f"{param} needs non-empty strings", param=param)
    # EBNF string literals take JSON-style escapes.
    rule = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return GrammarSpec(kind=GrammarKind.EBNF, text=f"root ::= {rule}")


def grammar_kind(text: str) -> GrammarKind:
    """EBNF or Lark, as vLLM tells them apart (``grammar_is_likely_lark``): a grammar with a
    ``::=`` rule outside comments is EBNF, any other is Lark. A grammar given in the wrong
    dialect does not compile: a 400, never an unconstrained answer."""
    for line in text.split("\n"):
        if _EBNF_RULE.search(_GRAMMAR_COMMENT.sub("", line)):
            return GrammarKind.EBNF
    return GrammarKind.LARK


def _structured_outputs_spec(so: StructuredOutputs) -> GrammarSpec:
    """vLLM's ``structured_outputs``: exactly one constraint, and only options honoured exactly."""
    fields.check_structured_outputs(so.model_dump(by_alias=True, exclude_unset=True))
    given = [
        name
        for name, value in (
            ("json", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object),
        )
        if value is not None
    ]
    if not given:
        raise ApiError.invalid(
            "structured_outputs needs one constraint: json, regex, choice, grammar or json_object",
            param="structured_outputs",
        )
    if len(given) > 1:
        raise ApiError.invalid(
            f"structured_outputs has more than one constraint ({', '.join(given)}); send one",
            param=f"structured_outputs.{given[1]}",
        )
    if so.json_ is not None:
        return _schema_spec(so.json_)
    if so.regex is not None:
        return GrammarSpec(kind=GrammarKind.REGEX, text=so.regex)
    if so.choice is not None:
        return _choice_spec(so.choice, "structured_outputs.choice")
    if so.grammar is not None:
        return GrammarSpec(kind=grammar_kind(so.grammar), text=so.grammar)
    if not so.json_object:
        # vLLM counts json_object: false as a constraint too; "no constraint" is not what it asks.
        raise ApiError.invalid("structured_outputs.json_object must be true", param="structured_outputs.json_object")
    return _schema_spec({"type": "object"})


def _one_grammar(grammars: list[tuple[str, GrammarSpec]], body: _Generation) -> GrammarSpec | None:
    if len(grammars) > 1:
        names = ", ".join(name for name, _ in grammars)
        raise ApiError.invalid(f"more than one output constraint given ({names}); send one", param=grammars[1][0])
    spec = grammars[0][1] if grammars else None
    options = {
        "guided_decoding_backend": body.guided_decoding_backend,
        "guided_checked": body.guided_checked,
        "guided_max_attempts": body.guided_max_attempts,
    }
    given = [name for name, value in options.items() if value is not None]
    if spec is None:
        if given:
            raise ApiError.invalid(
                f"{given[0]} needs an output constraint (response_format, tools, structured_outputs or guided_*)",
                param=given[0],
            )
        return None
    backend = body.guided_decoding_backend
    if backend is not None:
        if backend not in BACKEND_NAMES:
            raise ApiError.invalid(
                f"unknown guided_decoding_backend {backend!r}; known: {', '.join(sorted(BACKEND_NAMES))}",
                param="guided_decoding_backend",
            )
        spec = dataclasses.replace(spec, backend=BACKEND_NAMES[backend])
    # guided_checked travels as GenerationRequest.checked: unset means the server's --grammar-fallback.
    return spec
