"""Response and stream-chunk bodies in OpenAI's shapes (plain dicts, serialised once by the caller).

Finish reasons: only the ones in ``FINISH_REASONS`` are successes. Every
other reason (``ERROR``, ``CANCELLED`` by a shutdown, and any reason added
later, such as an output that failed its end-of-request grammar check) is an
error response, never a 200 with text: ``finish_error`` says which, by the failure's
``ErrorKind`` in the error table (a caught violation is ``grammar_violation``;
docs/api-errors.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specmask.gpu_worker.types import ErrorKind, FinishReason
from specmask.orchestrator.api.error_table import FAILED
from specmask.orchestrator.api.http.errors import GRAMMAR_VIOLATION, UNAVAILABLE, ApiError
from specmask.orchestrator.api.http.tool_grammar import ToolGrammar, parse_calls, split_calls, text_content
from specmask.orchestrator.output_check import OutputChecker
from specmask.orchestrator.token_text import TokenTexts
from specmask.orchestrator.types import GrammarReport, OutputLogprob, Usage

# Engine finish reason -> OpenAI finish_reason, for the reasons that are a success.
FINISH_REASONS: dict[FinishReason, str] = {
    FinishReason.STOP: "stop",
    FinishReason.GRAMMAR_COMPLETE: "stop",
    FinishReason.LENGTH: "length",
}
USAGE_EXTENSION_KEY = "specmask"


def finish_error(reason: FinishReason, error: str | None, kind: ErrorKind | None = None) -> ApiError | None:
    """None for a successful finish, else the error the client gets instead of the output: by the
    failure's ``kind`` (None: the reason's own, ``ErrorKind.of``) in the error table."""
    if reason in FINISH_REASONS:
        return None
    failure = ErrorKind.of(reason, kind)
    if failure is None:  # CANCELLED: only a shutdown cancels a request whose client still waits
        return ApiError(UNAVAILABLE, "the request was cancelled: the server is shutting down")
    wire = FAILED[failure]
    if wire.own_words:
        return ApiError(wire.http, error or failure.value.replace("_", " "), param=wire.param)
    detail = f": {error}" if error else ""
    return ApiError(wire.http, f"generation failed ({reason.value}){detail}", param=wire.param)


def grammar_body(grammar: GrammarReport) -> dict[str, Any]:
    """``usage.specmask.grammar``: how the output was constrained."""
    return {
        "enforcement": grammar.enforcement,
        "backend": grammar.backend,
        "attempts": grammar.attempts,
        "relaxed": list(grammar.relaxed),
    }


def usage_body(usage: Usage, grammar: GrammarReport | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        USAGE_EXTENSION_KEY: {
            "target_forwards": usage.target_forwards,
            "drafts_proposed": usage.drafts_proposed,
            "drafts_accepted": usage.drafts_accepted,
            "acceptance_rate": usage.acceptance_rate,
            "tokens_per_target_forward": usage.tokens_per_target_forward,
            "mask_time_s": usage.mask_time_s,
        },
    }
    if grammar is not None:
        body[USAGE_EXTENSION_KEY]["grammar"] = grammar_body(grammar)
    return body


@dataclass(frozen=True)
class Envelope:
    """What every body of one response shares."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


def _body(env: Envelope, obj: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    """One response body: the envelope, its choices and (on final bodies) its usage."""
    body: dict[str, Any] = {"id": env.id, "object": obj, "created": env.created, "model": env.model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def chat_completion(
    env: Envelope,
    message: dict[str, Any],
    finish_reason: str,
    usage: Usage,
    grammar: GrammarReport | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return _body(env, "chat.completion", [choice], usage_body(usage, grammar))


def chat_message(
    text: str, reason: FinishReason, calls: ToolGrammar | None, checker: OutputChecker
) -> tuple[dict[str, Any], str]:
    """The assistant message and finish_reason of a successful finish.

    With tools, complete calls are ``tool_calls``, each checked against its tool's schema with
    ``checker`` (a failure is an error, never a success); text (tool_choice "auto") is content.
    Calls cut short (length, stop string) are plain content with that finish reason.
    """
    if calls is None:
        return {"role": "assistant", "content": text}, FINISH_REASONS[reason]
    before, call_text = split_calls(text, calls)
    if reason is FinishReason.GRAMMAR_COMPLETE and call_text is not None:
        try:
            parsed = parse_calls(call_text, calls, checker)
        except ValueError as exc:
            raise ApiError(
                GRAMMAR_VIOLATION, f"grammar violation: the generated tool call is not valid: {exc}"
            ) from None
        # Text before the calls is their content, as vLLM's parsers return it ("Let me check."),
        # whitespace too: the same text a stream has sent as content deltas.
        content = before or None
        return {"role": "assistant", "content": content, "tool_calls": parsed}, "tool_calls"
    return {"role": "assistant", "content": text_content(text, calls)}, FINISH_REASONS[reason]


# The reasoning's field names: vLLM's current one, and its former one (DeepSeek's API), which
# many clients still read. Both carry the same text.
REASONING_FIELDS = ("reasoning", "reasoning_content")


def with_reasoning(message: dict[str, Any], reasoning: str | None, unanswered: bool) -> dict[str, Any]:
    """The assistant message with its reasoning (None: the output had no section); ``unanswered``:
    the section never closed, so there is no content (vLLM sends ``content: null`` then)."""
    out = {**message, **{name: reasoning for name in REASONING_FIELDS}}
    if unanswered and not out.get("tool_calls"):
        out["content"] = None
    return out


def reasoning_delta(text: str) -> dict[str, Any]:
    """A stream delta carrying reasoning text."""
    return {name: text for name in REASONING_FIELDS}


def chat_chunk(
    env: Envelope, delta: dict[str, Any], finish_reason: str | None = None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _body(env, "chat.completion.chunk", [choice], None)


def completion(
    env: Envelope,
    text: str,
    finish_reason: str,
    usage: Usage,
    grammar: GrammarReport | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _body(env, "text_completion", [choice], usage_body(usage, grammar))


def completion_chunk(
    env: Envelope, text: str, finish_reason: str | None = None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _body(env, "text_completion", [choice], None)


def _chat_token(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": texts.text_of(token_id), "logprob": logprob, "bytes": list(texts.bytes_of(token_id))}


def chat_logprobs(entries: Sequence[OutputLogprob] | None, texts: TokenTexts) -> dict[str, Any]:
    """``choices[i].logprobs`` of chat: ``content`` per returned token (None when the answer has no
    content: tool calls), each with its ``top_logprobs`` (allowed tokens only, most likely first)."""
    content = None
    if entries is not None:
        content = [
            {
                **_chat_token(texts, e.token_id, e.logprob),
                "top_logprobs": [_chat_token(texts, t, v) for t, v in e.top],
            }
            for e in entries
        ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[OutputLogprob], texts: TokenTexts) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, alternatives as {token text: logprob}
    (two alternatives with the same text keep the likelier), ``text_offset`` into the text."""
    top: list[dict[str, float]] = []
    for e in entries:
        alternatives: dict[str, float] = {}
        for t, v in e.top:
            alternatives.setdefault(texts.text_of(t), v)
        top.append(alternatives)
    return {
        "tokens": [texts.text_of(e.token_id) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": [e.text_offset for e in entries],
    }


def usage_chunk(env: Envelope, obj: str, usage: Usage, grammar: GrammarReport | None = None) -> dict[str, Any]:
    """The final chunk of ``stream_options.include_usage``: no choices, the whole usage."""
    return _body(env, obj, [], usage_body(usage, grammar))
