"""Response and stream-chunk bodies in OpenAI's shapes (plain dicts, serialised once by the caller).

Finish reasons: only the ones in ``FINISH_REASONS`` are successes. Every
other reason (``ERROR``, ``CANCELLED`` by a shutdown, and any reason added
later, such as an output that failed its end-of-request grammar check) is an
error response, never a 200 with text: ``finish_error`` says which (a caught
violation is ``grammar_violation``; docs/api-errors.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from specmask.gpu_worker.mask_errors import MASK_TIER_UNAVAILABLE
from specmask.gpu_worker.types import FinishReason
from specmask.orchestrator.api.http.errors import (
    GENERATION_FAILED,
    GRAMMAR_VIOLATION,
    MASK_TIER_DOWN,
    UNAVAILABLE,
    ApiError,
)
from specmask.orchestrator.types import GrammarReport, Usage

# Engine finish reason -> OpenAI finish_reason, for the reasons that are a success.
FINISH_REASONS: dict[FinishReason, str] = {
    FinishReason.STOP: "stop",
    FinishReason.GRAMMAR_COMPLETE: "stop",
    FinishReason.LENGTH: "length",
}
USAGE_EXTENSION_KEY = "specmask"


def finish_error(reason: FinishReason, error: str | None) -> ApiError | None:
    """None for a successful finish, else the error the client gets instead of the output."""
    if reason in FINISH_REASONS:
        return None
    if reason is FinishReason.CANCELLED:
        return ApiError(UNAVAILABLE, "the request was cancelled: the server is shutting down")
    if reason is FinishReason.GRAMMAR_VIOLATION:
        return ApiError(GRAMMAR_VIOLATION, error or "grammar violation")
    if error and error.startswith(MASK_TIER_UNAVAILABLE):
        return ApiError(MASK_TIER_DOWN, error)
    detail = f": {error}" if error else ""
    return ApiError(GENERATION_FAILED, f"generation failed ({reason.value}){detail}")


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
    env: Envelope, message: dict[str, Any], finish_reason: str, usage: Usage, grammar: GrammarReport | None = None
) -> dict[str, Any]:
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    return _body(env, "chat.completion", [choice], usage_body(usage, grammar))


def chat_chunk(env: Envelope, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return _body(env, "chat.completion.chunk", [choice], None)


def completion(
    env: Envelope, text: str, finish_reason: str, usage: Usage, grammar: GrammarReport | None = None
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _body(env, "text_completion", [choice], usage_body(usage, grammar))


def completion_chunk(env: Envelope, text: str, finish_reason: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _body(env, "text_completion", [choice], None)


def usage_chunk(env: Envelope, obj: str, usage: Usage, grammar: GrammarReport | None = None) -> dict[str, Any]:
    """The final chunk of ``stream_options.include_usage``: no choices, the whole usage."""
    return _body(env, obj, [], usage_body(usage, grammar))
