"""Streamed answers (``"stream": true``): an admitted request's events as OpenAI SSE chunks.

Owns what the client reads once the 200 header is out: text as content deltas (the per-token
hot path through ``DeltaEncoder``), a chat's reasoning as its own deltas first, tool calls sent
only once complete and checked against their tool's schema (text that could still begin a
call is held back, with its tokens' logprobs), each chunk's logprobs, the usage chunk and
``[DONE]``. A failed finish is one error event with no ``[DONE]`` (sse.py), never a success.
Parsing, admission and the non-streamed answer are ``routes.OpenAIRoutes``'s. What clients
see is in docs/openai-api.md ("The answer", reasoning and logprobs: "Streaming").
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from aiohttp import web

from specmask.orchestrator import reasoning
from specmask.orchestrator.api.http import responses as rsp
from specmask.orchestrator.api.http import tool_grammar
from specmask.orchestrator.api.http.errors import ApiError
from specmask.orchestrator.api.http.sse import DeltaEncoder, EventStream
from specmask.orchestrator.output_check import OutputChecker
from specmask.orchestrator.request import Request
from specmask.orchestrator.token_text import TokenTexts
from specmask.orchestrator.types import GrammarReport, OutputLogprob, RequestOutput, Usage

logger = logging.getLogger(__name__)


async def stream_chat(
    http: web.Request,
    admitted: Request,
    env: rsp.Envelope,
    headers: dict[str, str],
    *,
    calls: tool_grammar.ToolGrammar | None,
    checker: OutputChecker,
    include_usage: bool,
    texts: TokenTexts | None = None,
    thinking: reasoning.ReasoningFormat | None = None,
) -> web.StreamResponse:
    """``calls``: the request's tools (None: no tools); complete calls are checked with
    ``checker``. ``texts``: the request asked for logprobs; each text chunk then carries its
    tokens'. ``thinking``: the output starts with reasoning, streamed as its own deltas first."""
    stream = await EventStream.open(http, headers)
    deltas = DeltaEncoder(rsp.chat_chunk(env, {"content": DeltaEncoder.PLACEHOLDER}))
    sections = reasoning.ReasoningStream(thinking) if thinking is not None else None
    # Tool calls are sent once complete and checked; text is streamed (its start is held
    # while it could still begin a call).
    split = tool_grammar.StreamSplit(calls)
    try:
        await stream.send(rsp.chat_chunk(env, {"role": "assistant", "content": ""}))
        held: list[str] = []
        held_logprobs: list[OutputLogprob] = []
        output_chars = 0  # the whole output's so far, which logprob offsets count in
        async for out in admitted.events():
            output_chars += len(out.text)
            if sections is not None:  # what follows sees only the content
                out = await _send_reasoning(stream, env, sections, out, texts)
            content, call_text = split.feed(out.text) if out.text else ("", "")
            if call_text:
                held.append(call_text)
            if content and call_text:  # text, then the calls' start: each its tokens
                tokens = [*held_logprobs, *(out.logprobs or ())]
                calls_at = output_chars - len(call_text)
                held_logprobs = [e for e in tokens if e.text_offset >= calls_at]
                lp = (
                    None if texts is None else rsp.chat_logprobs([e for e in tokens if e.text_offset < calls_at], texts)
                )
                await stream.send(rsp.chat_chunk(env, {"content": content}, logprobs=lp))
            elif split.calls or (out.text and not content):
                held_logprobs.extend(out.logprobs or ())  # held text's tokens (or tokens after it)
            elif texts is not None and (content or out.logprobs):
                tokens, held_logprobs = [*held_logprobs, *(out.logprobs or ())], []
                if split.holding:  # an end that may begin a call keeps its tokens back with it
                    held_from = output_chars - split.holding
                    held_logprobs = [e for e in tokens if e.text_offset >= held_from]
                    tokens = [e for e in tokens if e.text_offset < held_from]
                lp = rsp.chat_logprobs(tokens, texts)
                await stream.send(rsp.chat_chunk(env, {"content": content}, logprobs=lp))
            elif content:
                await stream.send_raw(deltas.encode(content))
            if not out.finished:
                continue
            assert out.finish_reason is not None and out.usage is not None
            error = rsp.finish_error(out.finish_reason, out.error, out.error_kind)
            if error is not None:
                await stream.error(error)
                return stream.response
            if split.calls:
                try:
                    message, finish = rsp.chat_message("".join(held), out.finish_reason, calls, checker)
                except ApiError as exc:
                    await stream.error(exc)
                    return stream.response
                await _send_calls(stream, env, message, held_logprobs, texts)
            else:
                finish = rsp.FINISH_REASONS[out.finish_reason]
                pending = split.pending()  # a start that never became either branch: text
                if pending or (texts is not None and held_logprobs):
                    last = None if texts is None else rsp.chat_logprobs(held_logprobs, texts)
                    await stream.send(rsp.chat_chunk(env, {"content": pending}, logprobs=last))
            await stream.send(rsp.chat_chunk(env, {}, finish))
            await _finish_stream(stream, env, "chat.completion.chunk", out.usage, include_usage, out.grammar)
    except ConnectionResetError:
        logger.info("[request_id=%s] client went away mid-stream", admitted.request_id)
    return stream.response


async def _send_reasoning(
    stream: EventStream,
    env: rsp.Envelope,
    sections: reasoning.ReasoningStream,
    out: RequestOutput,
    texts: TokenTexts | None,
) -> RequestOutput:
    """Send the event's reasoning as a reasoning delta; return the event holding only its content.
    Its tokens' logprobs go with the reasoning delta when it has no content, else with the content."""
    thought, content = sections.feed(out.text)
    if out.finished:
        more_thought, more_content = sections.finish()
        thought, content = thought + more_thought, content + more_content
    if thought:
        logprobs = None
        if texts is not None and not content:
            logprobs, out = rsp.chat_logprobs(out.logprobs or (), texts), dataclasses.replace(out, logprobs=None)
        await stream.send(rsp.chat_chunk(env, rsp.reasoning_delta(thought), logprobs=logprobs))
    return dataclasses.replace(out, text=content)


async def _send_calls(
    stream: EventStream,
    env: rsp.Envelope,
    message: dict[str, Any],
    held_logprobs: list[OutputLogprob],
    texts: TokenTexts | None,
) -> None:
    """The held output's deltas, as vLLM streams calls: per call, one delta with its id and
    name, then one with its arguments; or content, when the calls were cut short."""
    calls = message.get("tool_calls")
    if not calls:
        lp = None if texts is None else rsp.chat_logprobs(held_logprobs, texts)
        await stream.send(rsp.chat_chunk(env, {"content": message["content"]}, logprobs=lp))
        return
    # Tool calls are not content: their tokens have no content logprobs (OpenAI's shape).
    no_content = None if texts is None else rsp.chat_logprobs(None, texts)
    for i, call in enumerate(calls):
        head = {"index": i, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"]}}
        await stream.send(rsp.chat_chunk(env, {"tool_calls": [head]}, logprobs=no_content if i == 0 else None))
        arguments = {"index": i, "function": {"arguments": call["function"]["arguments"]}}
        await stream.send(rsp.chat_chunk(env, {"tool_calls": [arguments]}))


async def stream_completion(
    http: web.Request,
    admitted: Request,
    env: rsp.Envelope,
    headers: dict[str, str],
    *,
    include_usage: bool,
    texts: TokenTexts | None = None,
) -> web.StreamResponse:
    """``texts``: the request asked for logprobs; each chunk then carries its tokens'."""
    stream = await EventStream.open(http, headers)
    deltas = DeltaEncoder(rsp.completion_chunk(env, DeltaEncoder.PLACEHOLDER))
    try:
        async for out in admitted.events():
            lp = None if texts is None else rsp.completion_logprobs(out.logprobs or (), texts)
            if out.finished:
                assert out.finish_reason is not None and out.usage is not None
                error = rsp.finish_error(out.finish_reason, out.error, out.error_kind)
                if error is not None:
                    await stream.error(error)
                    return stream.response
                finish = rsp.FINISH_REASONS[out.finish_reason]
                await stream.send(rsp.completion_chunk(env, out.text, finish, logprobs=lp))
                await _finish_stream(stream, env, "text_completion", out.usage, include_usage, out.grammar)
            elif texts is not None and (out.text or out.logprobs):
                await stream.send(rsp.completion_chunk(env, out.text, logprobs=lp))
            elif out.text:
                await stream.send_raw(deltas.encode(out.text))
    except ConnectionResetError:
        logger.info("[request_id=%s] client went away mid-stream", admitted.request_id)
    return stream.response


async def _finish_stream(
    stream: EventStream,
    env: rsp.Envelope,
    obj: str,
    usage: Usage,
    include: bool,
    grammar: GrammarReport | None = None,
) -> None:
    if include:
        await stream.send(rsp.usage_chunk(env, obj, usage, grammar))
    await stream.done()
