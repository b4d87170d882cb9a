"""OpenAI request bodies -> the engine's ``GenerationRequest`` (the same one gRPC builds).

Refusals here are ``ApiError`` (400) with the offending field in ``param``.
Semantic checks of values (ranges, context length, the grammar itself) are
left to the engine's validator, exactly as for gRPC, so both APIs accept and
refuse the same things with the same messages.

Defaults that differ from the gRPC API, to match OpenAI: an omitted
``temperature`` is 1.0 (gRPC: greedy). Structured output has exactly one
source per request: ``response_format`` (json_schema / json_object), a tool
call (``tools`` + ``tool_choice``), or one ``guided_*`` extension field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.orchestrator.api.http import tools as tool_calls
from specmask.orchestrator.api.http.errors import ApiError
from specmask.orchestrator.api.http.prompting import ChatPrompter
from specmask.orchestrator.api.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    _Generation,
)
from specmask.orchestrator.api.http.tool_grammar import AutoTools, auto_tools, tools_prompt, with_system_text
from specmask.orchestrator.chat import ChatMessage, ChatPrompt
from specmask.orchestrator.types import GenerationRequest, SamplingOptions, SpeculationOptions

OPENAI_DEFAULT_TEMPERATURE = 1.0
# Alternatives per token: chat's top_logprobs (OpenAI: 0..20), the legacy completions' logprobs (0..5).
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# guided_decoding_backend values -> GrammarSpec.backend ("" = the mask service picks). vLLM calls
# llguidance "guidance"; its other backends (outlines, lm-format-enforcer) are not here: a 400.
BACKEND_NAMES = {"auto": "", "xgrammar": "xgrammar", "llguidance": "llguidance", "guidance": "llguidance"}


@dataclass(frozen=True)
class Translated:
    request: GenerationRequest
    tool_call: bool = False  # the output is a tool call to parse into message.tool_calls
    auto_tools: AutoTools | None = None  # tool_choice "auto": the output is text or calls (tool_grammar)


def chat_request(body: ChatCompletionRequest, request_id: str, prompter: ChatPrompter) -> Translated:
    logprobs = _chat_logprobs(body)
    if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
        raise ApiError.invalid("max_tokens and max_completion_tokens disagree; send one", param="max_tokens")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    grammars: list[tuple[str, GrammarSpec]] = []
    tool_schema = None
    auto = None
    if body.tools and body.tool_choice in (None, "auto"):
        # OpenAI's default with tools: the model answers in text or calls tools.
        auto = auto_tools(body.tools, parallel=body.parallel_tool_calls is not False)
        grammars.append(("tools", auto.grammar))
    elif body.tools:
        tool_schema = tool_calls.call_schema(body.tools, body.tool_choice)
        if tool_schema is not None:
            grammars.append(("tools", _schema_spec(tool_schema)))
    elif body.tool_choice not in (None, "none"):
        raise ApiError.invalid("tool_choice was given without tools", param="tool_choice")
    grammars += _format_grammar(body.response_format)
    grammars += _guided_grammars(body)
    if auto is not None and len(grammars) > 1:
        # "text or a call" leaves no room for a second constraint on the text.
        raise ApiError.invalid(
            f'tools with tool_choice "auto" cannot be combined with {grammars[1][0]}; '
            'use tool_choice "required" or a named function',
            param=grammars[1][0],
        )
    prompt = _auto_prompt(body, prompter) if auto is not None else _chat_prompt(body, prompter, tool_schema is not None)
    return Translated(
        request=_request(body, request_id, prompt, max_tokens, _one_grammar(grammars, body), logprobs),
        tool_call=tool_schema is not None,
        auto_tools=auto,
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


def _auto_prompt(body: ChatCompletionRequest, prompter: ChatPrompter) -> str:
    """The conversation with the tools: the chat template renders them when it knows how;
    otherwise a system message lists them and shows the call format the grammar admits."""
    if body.schema_instruction is not None:
        raise ApiError.invalid("schema_instruction applies to plain chats only (no tools)", param="schema_instruction")
    assert body.tools is not None
    if prompter.supports_tools:
        return prompter.render(body.messages, body.tools)
    return prompter.render(with_system_text(body.messages, tools_prompt(body.tools)), None)


def _chat_prompt(body: ChatCompletionRequest, prompter: ChatPrompter, tool_call: bool) -> str | ChatPrompt:
    """Plain conversations go to the engine as a ``ChatPrompt`` and are rendered by its validator,
    exactly as gRPC chat requests are (off the event loop, with the JSON Schema instruction).
    Tool calls, and conversations carrying tool calls or results, are rendered here: the
    template gets the tools and the calls, which ``ChatPrompt`` does not carry."""
    plain = not tool_call and all(
        m.tool_calls is None and m.tool_call_id is None and m.name is None for m in body.messages
    )
    if plain:
        messages = tuple(ChatMessage(role=m.role, content=m.text) for m in body.messages)
        instruction = body.schema_instruction
        if instruction is None and body.response_format is not None and body.response_format.type == "json_object":
            # JSON mode is "any object": an instruction would show the model {"type": "object"} to copy.
            instruction = ""
        return ChatPrompt(messages=messages, schema_instruction=instruction)
    if body.schema_instruction is not None:
        raise ApiError.invalid("schema_instruction applies to plain chats only (no tools)", param="schema_instruction")
    return prompter.render(body.messages, body.tools if tool_call else None)


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
    if body.stream_options is not None and not body.stream:
        raise ApiError.invalid("stream_options needs stream=true", param="stream_options")
    stop: tuple[str, ...] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    sampling = SamplingOptions(
        temperature=OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        max_tokens=max_tokens,
        stop=stop,
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
        if not body.guided_choice or not all(body.guided_choice):
            raise ApiError.invalid("guided_choice needs non-empty strings", param="guided_choice")
        # EBNF string literals take JSON-style escapes.
        rule = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(body.guided_choice))
        out.append(("guided_choice", GrammarSpec(kind=GrammarKind.EBNF, text=f"root ::= {rule}")))
    return out


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
                f"{given[0]} needs an output constraint (response_format, tools or guided_*)", param=given[0]
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
    if body.guided_checked:
        spec = dataclasses.replace(spec, checked=True)
    return spec
