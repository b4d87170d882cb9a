"""Streamed answers (streaming.py) over real HTTP on loopback: a real ``Request`` fed worker step
outputs, streamed by ``stream_chat`` / ``stream_completion`` from an aiohttp handler and read back
as SSE. What a client sees: text deltas that add up to the output, reasoning first, tool calls
only once complete and checked (never a call's text as content, never an unchecked call), each
token's logprob once with the text it belongs to, usage then ``[DONE]``, and a failed finish as
one error event with no ``[DONE]``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, StepOutput, TokenLogprob
from specmask.orchestrator import reasoning
from specmask.orchestrator.api.http import responses as rsp
from specmask.orchestrator.api.http import streaming
from specmask.orchestrator.api.http.protocol import Tool
from specmask.orchestrator.api.http.tool_grammar import ToolGrammar, tool_grammar
from specmask.orchestrator.output_check import OutputChecker
from specmask.orchestrator.request import Request
from specmask.orchestrator.token_text import TokenTexts

DONE = "[DONE]"
ENV = rsp.Envelope(id="chatcmpl-req-1", model="m", created=7)
CHECKER = OutputChecker()
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "weather", "parameters": WEATHER}})]


@pytest.fixture(scope="module")
def calls() -> ToolGrammar:
    return tool_grammar(TOOLS, "auto", parallel=True)


def _call(name: str, arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _request(
    ids: list[int],
    tokenizer: Any,
    reason: FinishReason = FinishReason.GRAMMAR_COMPLETE,
    *,
    error: str | None = None,
    logprobs: bool = False,
    per_step: int = 1,
) -> Request:
    """An admitted request the worker stepped ``per_step`` tokens at a time, then finished with
    ``reason``; with ``logprobs``, token i's logprob is -i (a tag)."""
    request = Request(
        NewSequence("req-1", (1, 2, 3), None, SamplingParams(logprobs=1 if logprobs else None)), tokenizer=tokenizer
    )
    for at in range(0, len(ids), per_step):
        step = ids[at : at + per_step]
        entries = [TokenLogprob(t, -float(at + j), ((t, -0.5),)) for j, t in enumerate(step)] if logprobs else None
        request.apply_step(StepOutput("req-1", step, logprobs=entries))
    request.finish(reason, error)
    return request


def _stream(respond: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> list[Any]:
    """The events a client reads from ``respond`` over loopback HTTP: JSON bodies, then DONE."""

    async def go() -> list[Any]:
        app = web.Application()
        app.router.add_post("/", respond)
        async with (
            TestServer(app) as server,
            ClientSession() as session,
            session.post(server.make_url("/")) as response,
        ):
            assert response.status == 200
            assert response.headers["Content-Type"] == "text/event-stream"
            assert response.headers["X-Request-Id"] == "req-1"
            raw = await response.text()
        assert raw.endswith("\n\n")
        events = [part.removeprefix("data: ") for part in raw.split("\n\n")[:-1]]
        return [DONE if e == DONE else json.loads(e) for e in events]

    return asyncio.run(go())


def _chat(request: Request, **kwargs: Any) -> list[Any]:
    async def respond(http: web.Request) -> web.StreamResponse:
        args: dict[str, Any] = {"calls": None, "checker": CHECKER, "include_usage": True, **kwargs}
        return await streaming.stream_chat(http, request, ENV, {"X-Request-Id": "req-1"}, **args)

    return _stream(respond)


def _deltas(events: list[Any]) -> list[dict[str, Any]]:
    return [e["choices"][0]["delta"] for e in events if e != DONE and e.get("choices")]


def _content(events: list[Any]) -> str:
    return "".join(d.get("content") or "" for d in _deltas(events))


def _finishes(events: list[Any]) -> list[str]:
    return [e["choices"][0]["finish_reason"] for e in events if e != DONE and e.get("choices")][-1:]


def test_completion_stream_adds_up_then_usage_then_done(bpe_tokenizer) -> None:
    text = 'Zürich 🙂 "quoted" \\ and\nnewline'
    ids = bpe_tokenizer.encode(text).ids
    request = _request(ids, bpe_tokenizer, FinishReason.LENGTH)

    async def respond(http: web.Request) -> web.StreamResponse:
        return await streaming.stream_completion(http, request, ENV, {"X-Request-Id": "req-1"}, include_usage=True)

    events = _stream(respond)
    assert events[-1] == DONE
    *chunks, usage = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert all(c["object"] == "text_completion" and c["id"] == ENV.id for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(ids)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_failed_finish_is_one_error_event_and_no_done(bpe_tokenizer, chat: bool) -> None:
    request = _request(bpe_tokenizer.encode("{").ids, bpe_tokenizer, FinishReason.GRAMMAR_VIOLATION, error="bad")

    async def respond(http: web.Request) -> web.StreamResponse:
        headers = {"X-Request-Id": "req-1"}
        if chat:
            return await streaming.stream_chat(
                http, request, ENV, headers, calls=None, checker=CHECKER, include_usage=True
            )
        return await streaming.stream_completion(http, request, ENV, headers, include_usage=True)

    events = _stream(respond)
    assert DONE not in events
    assert events[-1]["error"]["code"] == "grammar_violation" and "bad" in events[-1]["error"]["message"]
    assert not any(e.get("usage") for e in events) and not any(f for f in _finishes(events))


def test_chat_streams_checked_tool_calls_after_their_text(bpe_tokenizer, calls) -> None:
    call = _call("weather", {"city": "Oslo", "days": 3})
    text = "Let me check. " + call
    events = _chat(_request(bpe_tokenizer.encode(text).ids, bpe_tokenizer), calls=calls)
    assert events[-1] == DONE and events[-2]["usage"]["completion_tokens"] > 0
    deltas = _deltas(events)
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert _content(events) == "Let me check. "  # the call's text never reaches the client as content
    streamed = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    head, arguments = streamed
    assert head["function"] == {"name": "weather"} and head["type"] == "function" and head["index"] == 0
    assert json.loads(arguments["function"]["arguments"]) == {"city": "Oslo", "days": 3}
    assert _finishes(events) == ["tool_calls"]
    # The same answer as the non-streamed one.
    message, finish = rsp.chat_message(text, FinishReason.GRAMMAR_COMPLETE, calls, CHECKER)
    assert finish == "tool_calls" and message["content"] == "Let me check. "
    assert message["tool_calls"][0]["function"]["arguments"] == arguments["function"]["arguments"]


def test_chat_tool_call_failing_its_schema_is_an_error_not_a_call(bpe_tokenizer, calls) -> None:
    text = _call("weather", {"city": "Oslo", "days": 9})  # days: maximum 7
    events = _chat(_request(bpe_tokenizer.encode(text).ids, bpe_tokenizer), calls=calls)
    assert DONE not in events and not any("tool_calls" in d for d in _deltas(events))
    assert events[-1]["error"]["code"] == "grammar_violation"
    assert "tool call is not valid" in events[-1]["error"]["message"]


def test_chat_call_cut_short_by_length_is_content(bpe_tokenizer, calls) -> None:
    text = '<tool_call>\n{"name": "weather", "argu'
    events = _chat(_request(bpe_tokenizer.encode(text).ids, bpe_tokenizer, FinishReason.LENGTH), calls=calls)
    assert events[-1] == DONE and not any("tool_calls" in d for d in _deltas(events))
    assert _content(events) == rsp.chat_message(text, FinishReason.LENGTH, calls, CHECKER)[0]["content"] == text
    assert _finishes(events) == ["length"]


def test_chat_streams_reasoning_first_as_the_non_streamed_split(bpe_tokenizer) -> None:
    fmt = reasoning.FORMATS[reasoning.ReasoningParser.QWEN3]
    text = "<think>\nOslo is cold: ünïcode 🙂</think>\n\nTake a coat."
    events = _chat(_request(bpe_tokenizer.encode(text).ids, bpe_tokenizer), thinking=fmt)
    deltas = _deltas(events)[1:]  # after the role
    kinds = ["reasoning" if "reasoning" in d else "content" if d.get("content") else "other" for d in deltas]
    assert "content" in kinds and "reasoning" in kinds
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert all(d["reasoning"] == d["reasoning_content"] for d in deltas if "reasoning" in d)
    answer = reasoning.split_answer(fmt, text)
    assert "".join(d.get("reasoning", "") for d in deltas) == answer.reasoning
    assert _content(events) == answer.content == "Take a coat."
    assert events[-1] == DONE


def _sent_logprobs(events: list[Any]) -> list[dict[str, Any]]:
    chunks = [e["choices"][0] for e in events if e != DONE and e.get("choices")]
    return [entry for c in chunks if c["logprobs"] and c["logprobs"]["content"] for entry in c["logprobs"]["content"]]


@pytest.mark.parametrize("per_step", [1, 3, 64])
def test_chat_logprobs_go_with_content_never_with_calls(bpe_tokenizer, calls, per_step: int) -> None:
    before = bpe_tokenizer.encode("Sure. ").ids
    call = bpe_tokenizer.encode(_call("weather", {"city": "Paris", "days": 1})).ids
    texts = TokenTexts(bpe_tokenizer)
    request = _request([*before, *call], bpe_tokenizer, logprobs=True, per_step=per_step)
    events = _chat(request, calls=calls, texts=texts)
    assert events[-1] == DONE and _content(events) == "Sure. "
    sent = _sent_logprobs(events)
    # Each content token once, in order, each with its bytes; the call's tokens have none.
    assert [entry["logprob"] for entry in sent] == [-float(i) for i in range(len(before))]
    assert b"".join(bytes(entry["bytes"]) for entry in sent) == b"Sure. "
    chunks = [e["choices"][0] for e in events if e != DONE and e.get("choices")]
    (head,) = [c for c in chunks if "tool_calls" in c["delta"] and "id" in c["delta"]["tool_calls"][0]]
    assert head["logprobs"] == {"content": None, "refusal": None}


@pytest.mark.parametrize("per_step", [1, 3, 64])
def test_chat_logprobs_of_a_call_cut_short_are_sent_once_as_content(bpe_tokenizer, calls, per_step: int) -> None:
    text = 'Sure. <tool_call>\n{"name": "weath'
    ids = bpe_tokenizer.encode(text).ids
    request = _request(ids, bpe_tokenizer, FinishReason.LENGTH, logprobs=True, per_step=per_step)
    events = _chat(request, calls=calls, texts=TokenTexts(bpe_tokenizer))
    assert _content(events) == text and _finishes(events) == ["length"]
    assert [entry["logprob"] for entry in _sent_logprobs(events)] == [-float(i) for i in range(len(ids))]


def test_chat_reasoning_cut_short_flushes_what_it_held(bpe_tokenizer) -> None:
    fmt = reasoning.FORMATS[reasoning.ReasoningParser.QWEN3]
    text = "<think>\nstill weighing it </thi"  # the length limit hit inside a possible end tag
    events = _chat(_request(bpe_tokenizer.encode(text).ids, bpe_tokenizer, FinishReason.LENGTH), thinking=fmt)
    thought = "".join(d.get("reasoning", "") for d in _deltas(events))
    assert thought == reasoning.split_answer(fmt, text).reasoning and thought.endswith("</thi")
    assert _content(events) == "" and _finishes(events) == ["length"] and events[-1] == DONE


@pytest.mark.parametrize("per_step", [1, 4])
def test_chat_reasoning_logprobs_each_token_once(bpe_tokenizer, per_step: int) -> None:
    fmt = reasoning.FORMATS[reasoning.ReasoningParser.QWEN3]
    ids = bpe_tokenizer.encode("<think>\nhmm</think>\n\nYes.").ids
    request = _request(ids, bpe_tokenizer, logprobs=True, per_step=per_step)
    events = _chat(request, thinking=fmt, texts=TokenTexts(bpe_tokenizer))
    assert [entry["logprob"] for entry in _sent_logprobs(events)] == [-float(i) for i in range(len(ids))]
