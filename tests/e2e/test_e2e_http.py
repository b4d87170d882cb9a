"""The OpenAI-compatible HTTP API through the full stack, driven by the real `openai` package.

The stack (conftest) serves HTTP on a free port beside gRPC, on the same
engine: chat and completions (sync, async, streaming), structured outputs
validated with jsonschema, tool calls, refusals (400/404/429), client
disconnects freeing the request, and malformed bodies answered with 400 and an
OpenAI error object.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2 as httpx
import jsonschema
import openai
import pytest

from tests.e2e.stack import (
    BOUNDED_SCHEMA,
    ENDLESS_MAX_TOKENS,
    ENDLESS_SCHEMA,
    LONG_MAX_TOKENS,
    LONG_SCHEMA,
    MAX_BATCH,
    MAX_QUEUE,
    PROMPT,
    ThreadStack,
)

pytestmark = pytest.mark.slow

# Bounded structures (see stack.py): each completes within its token budget.
SCHEMAS: dict[str, dict[str, Any]] = {
    "bounded_object": BOUNDED_SCHEMA,
    "enum_and_int": {
        "type": "object",
        "properties": {"unit": {"enum": ["kg", "lb"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["unit", "n"],
        "additionalProperties": False,
    },
    "array_of_objects": LONG_SCHEMA,
    "choice_of_shapes": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"a": {"type": "boolean"}},
                "required": ["a"],
                "additionalProperties": False,
            },
            {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2, "maxItems": 2},
        ]
    },
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {"on": {"type": "boolean"}, "days": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
    "required": ["on", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
TOOL_PARAMS = {"get_weather": WEATHER, "set_alarm": ALARM}
MESSAGES = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": PROMPT}]
# The tiny model's context is 512 tokens: requests with long budgets leave out the schema
# instruction a JSON Schema chat gets by default (test_chat_gets_the_schema_instruction keeps it).
NO_INSTRUCTION = {"schema_instruction": ""}


@pytest.fixture(scope="module")
def base_url(stack: ThreadStack) -> str:
    return stack.http_url + "/v1"


def _json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def test_models_and_health(base_url: str, model: str) -> None:
    assert httpx.get(base_url.removesuffix("/v1") + "/health").json() == {"status": "ok"}
    card = httpx.get(f"{base_url}/models/{model}").json()
    assert card["id"] == model and card["max_model_len"] > 0


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_chat_json_schema_validates(openai_client: openai.OpenAI, model: str, name: str) -> None:
    schema = SCHEMAS[name]
    resp = openai_client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        response_format=_json_format(schema),
        temperature=1.0,
        seed=11,
        max_tokens=LONG_MAX_TOKENS,
        extra_body=NO_INSTRUCTION,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)
    usage = resp.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.completion_tokens > 0
    ext = usage.model_extra["specmask"]
    assert ext["target_forwards"] >= 1 and 0.0 <= ext["acceptance_rate"] <= 1.0


def test_chat_gets_the_schema_instruction_on_request(
    stack: ThreadStack, openai_client: openai.OpenAI, model: str
) -> None:
    """A plain JSON Schema chat goes through the engine's chat renderer (specmask/orchestrator/chat.py), which
    puts the schema in a system message only when asked (schema_instruction): the caller's messages
    are the prompt by default, and JSON mode never shows the model a schema to copy."""
    kwargs: dict[str, Any] = dict(
        model=model, messages=MESSAGES, response_format=_json_format(BOUNDED_SCHEMA), temperature=0.0, max_tokens=64
    )
    with_instruction = openai_client.chat.completions.create(**kwargs, extra_body={"schema_instruction": "default"})
    without = openai_client.chat.completions.create(**kwargs)
    assert with_instruction.usage.prompt_tokens > without.usage.prompt_tokens + 20
    off = openai_client.chat.completions.create(**kwargs, extra_body=NO_INSTRUCTION)
    assert off.usage.prompt_tokens == without.usage.prompt_tokens
    plain = openai_client.chat.completions.create(model=model, messages=MESSAGES, temperature=0.0, max_tokens=1)
    json_mode = openai_client.chat.completions.create(
        model=model, messages=MESSAGES, response_format={"type": "json_object"}, temperature=0.0, max_tokens=8
    )
    assert json_mode.usage.prompt_tokens == plain.usage.prompt_tokens
    for resp in (with_instruction, without):
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].message.content), BOUNDED_SCHEMA)


def test_chat_json_object_and_guided_regex(openai_client: openai.OpenAI, model: str) -> None:
    resp = openai_client.chat.completions.create(
        model=model, messages=MESSAGES, response_format={"type": "json_object"}, temperature=0.0, max_tokens=200
    )
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:  # an unbounded object may run out of budget; it is then reported as such
        assert resp.choices[0].finish_reason == "length"
    resp = openai_client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        extra_body={"guided_regex": "(yes|no)-[0-9]{2}", "speculation": {"k": 2, "proposers": ["grammar_forced"]}},
        max_tokens=20,
    )
    assert resp.choices[0].finish_reason == "stop"
    content = resp.choices[0].message.content
    assert content[:-3] in ("yes", "no") and content[-3] == "-" and content[-2:].isdigit()
    choice = openai_client.chat.completions.create(
        model=model, messages=MESSAGES, extra_body={"guided_choice": ["red", 'say "hi"']}, max_tokens=20
    )
    assert choice.choices[0].message.content in ("red", 'say "hi"')


def test_chat_async_concurrent(base_url: str, model: str) -> None:
    async def main() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as c:
            return await asyncio.gather(
                *(
                    c.chat.completions.create(
                        model=model,
                        messages=MESSAGES,
                        response_format=_json_format(BOUNDED_SCHEMA),
                        temperature=1.0,
                        seed=100 + i,
                        max_tokens=64,
                    )
                    for i in range(4)
                )
            )

    for resp in asyncio.run(main()):
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].message.content), BOUNDED_SCHEMA)


def test_chat_streaming_with_usage(openai_client: openai.OpenAI, model: str) -> None:
    stream = openai_client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        response_format=_json_format(LONG_SCHEMA),
        temperature=1.0,
        seed=5,
        max_tokens=LONG_MAX_TOKENS,
        extra_body=NO_INSTRUCTION,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # really streamed
    jsonschema.validate(json.loads(text), LONG_SCHEMA)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_completions_sync_and_streaming(openai_client: openai.OpenAI, model: str) -> None:
    resp = openai_client.completions.create(
        model=model, prompt=PROMPT, temperature=0.0, max_tokens=64, extra_body={"guided_json": BOUNDED_SCHEMA}
    )
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].text), BOUNDED_SCHEMA)
    # Greedy and the same grammar: the stream concatenates to the same text.
    stream = openai_client.completions.create(
        model=model,
        prompt=PROMPT,
        temperature=0.0,
        max_tokens=64,
        extra_body={"guided_json": BOUNDED_SCHEMA},
        stream=True,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == resp.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"
    free = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True})
    assert free.choices[0].finish_reason == "length" and free.usage.completion_tokens == 5


@pytest.mark.parametrize("choice", ["required", "set_alarm"])
def test_tool_calls_validate(openai_client: openai.OpenAI, model: str, choice: str) -> None:
    tool_choice: Any = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    for seed in (1, 2):
        resp = openai_client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Set an alarm or get the weather."}],
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,  # one call (a named choice is one call anyway)
            temperature=1.0,
            seed=seed,
            max_tokens=100,
        )
        message = resp.choices[0].message
        assert resp.choices[0].finish_reason == "tool_calls"
        assert message.content is None and len(message.tool_calls) == 1
        call = message.tool_calls[0].function
        if choice != "required":
            assert call.name == choice
        jsonschema.validate(json.loads(call.arguments), TOOL_PARAMS[call.name])


def test_tool_call_streamed(openai_client: openai.OpenAI, model: str) -> None:
    stream = openai_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=110,  # the call in its <tool_call> block, up to a token per character
        stream=True,
    )
    chunks = list(stream)
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    # As vLLM streams a call: its id and name first, then its arguments.
    head, arguments = deltas
    assert head.index == arguments.index == 0 and head.id and head.function.name == "get_weather"
    assert arguments.id is None and arguments.function.name is None
    jsonschema.validate(json.loads(arguments.function.arguments), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_refusals(openai_client: openai.OpenAI, model: str) -> None:
    refused = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            response_format=_json_format(refused),
            extra_body={"guided_checked": False},  # exact or refused (the server's default would relax it)
        )
    assert "uniqueItems" in exc.value.message
    assert exc.value.body["type"] == "invalid_request_error"
    cases: list[dict[str, Any]] = [
        {"n": 2},
        {"top_logprobs": 2},  # without logprobs: true
        {"extra_body": {"guided_regex": "a+", "guided_json": {"type": "object"}}},
        {"extra_body": {"guided_grammar": "root ::= undefined_rule"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"max_tokens": 10**6},
        {"extra_body": {"speculation": {"proposers": ["oracle"]}}},
    ]
    for kwargs in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            openai_client.chat.completions.create(model=model, messages=MESSAGES, **kwargs)
        assert exc.value.message, kwargs
    with pytest.raises(openai.NotFoundError) as not_found:
        openai_client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert not_found.value.body["code"] == "model_not_found"


def _deep_body(depth: int, model: str = "m") -> bytes:
    """A schema nested just under or past the interpreter's recursion limit."""
    schema = '{"type": "object", "properties": {"a": ' * depth + "{}" + "}}" * depth
    prefix = '{"model": "' + model + '", "messages": [{"role": "user", "content": "x"}], "guided_json": '
    return (prefix + schema + "}").encode()


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": "hi"}', "messages"),
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "role"),
        (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "content"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        (b"\xff\xfe", "not valid JSON"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "guided_json": ' + b'{"a": ' * 100_000,
            "deep",
        ),
        (_deep_body(960), "deep"),
    ],
)
def test_malformed_bodies_get_400(base_url: str, body: bytes, fragment: str) -> None:
    resp = httpx.post(f"{base_url}/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_schema_nested_near_the_recursion_limit_is_a_400(base_url: str, model: str) -> None:
    """It parses, but each later stage (translation, grammar checks) recurses over it: refused, never a 500."""
    resp = httpx.post(f"{base_url}/chat/completions", content=_deep_body(480, model), timeout=120)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"]


def test_unknown_route_and_method_are_json(base_url: str) -> None:
    assert httpx.get(f"{base_url}/nope").json()["error"]["message"]
    resp = httpx.get(f"{base_url}/chat/completions")
    assert resp.status_code == 405 and resp.json()["error"]["message"]


def test_disconnect_mid_stream_frees_the_request(stack: ThreadStack, base_url: str, model: str) -> None:
    stack.wait_idle()
    body = {
        "model": model,
        "messages": MESSAGES,
        "response_format": _json_format(ENDLESS_SCHEMA),
        "temperature": 1.0,
        "seed": 3,
        "max_tokens": ENDLESS_MAX_TOKENS,
        "stream": True,
        **NO_INSTRUCTION,
        "speculation": {"enabled": False},
    }
    with httpx.Client(timeout=120) as http, http.stream("POST", f"{base_url}/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        deltas = 0
        for line in lines:
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                deltas += 1
                if deltas >= 3:
                    break
        assert sum(stack.worker_num_active()) == 1 and stack.mask_session_count() == 1
    # The connection is closed: the handler is cancelled and the engine frees the request.
    active, sessions = stack.wait_idle()
    assert active == [0, 0] and sessions == 0
    assert stack.run(_num_live(stack)) == 0


def test_disconnect_while_waiting_for_a_unary_answer_frees_the_request(
    stack: ThreadStack, base_url: str, model: str
) -> None:
    stack.wait_idle()
    body = {
        "model": model,
        "messages": MESSAGES,
        "response_format": _json_format(ENDLESS_SCHEMA),
        "temperature": 1.0,
        "seed": 4,
        "max_tokens": ENDLESS_MAX_TOKENS,
        "speculation": {"enabled": False},
        **NO_INSTRUCTION,
    }
    # The client gives up (read timeout) mid-generation and closes the connection.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base_url}/chat/completions", json=body, timeout=httpx.Timeout(120, read=0.5))
    active, sessions = stack.wait_idle()
    assert active == [0, 0] and sessions == 0
    assert stack.run(_num_live(stack)) == 0


async def _num_live(stack: ThreadStack) -> int:
    assert stack.running is not None
    return stack.running.server.engine.num_live()


def test_overload_gets_429_with_retry_after(stack: ThreadStack, base_url: str, model: str) -> None:
    """A burst past batch + queue capacity: the excess gets 429 + Retry-After; the admitted
    streams are then dropped by the client, which frees everything."""
    stack.wait_idle()
    n = 2 * MAX_BATCH + MAX_QUEUE + 24

    async def main() -> list[tuple[int, str | None]]:
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            opened = []

            async def one(i: int) -> tuple[int, str | None]:
                body = {
                    "model": model,
                    "messages": MESSAGES,
                    "response_format": _json_format(ENDLESS_SCHEMA),
                    "temperature": 1.0,
                    "seed": i,
                    "max_tokens": ENDLESS_MAX_TOKENS,
                    "stream": True,
                    **NO_INSTRUCTION,
                }
                request = http.build_request("POST", f"{base_url}/chat/completions", json=body)
                resp = await http.send(request, stream=True)
                opened.append(resp)
                if resp.status_code != 200:
                    await resp.aread()
                return resp.status_code, resp.headers.get("retry-after")

            try:
                return await asyncio.gather(*(one(i) for i in range(n)))
            finally:
                for resp in opened:
                    await resp.aclose()

    results = asyncio.run(main())
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1
    assert all(retry == "1" for s, retry in results if s == 429)
    # The whole burst arrives at once: requests still validating count against the queue
    # bound, so at least the queue's worth is admitted (more once placement frees it).
    assert statuses.count(200) >= MAX_QUEUE
    active, sessions = stack.wait_idle(60)
    assert active == [0, 0] and sessions == 0
