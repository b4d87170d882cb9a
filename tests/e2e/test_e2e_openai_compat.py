"""OpenAI drop-in behaviour through the full stack with the real `openai` package: tools with
``tool_choice`` "auto" (and omitted) and "none", JSON mode without an injected schema.

Every answer is checked the way a client would use it: text is text; a tool call names one
of the tools and its arguments validate against that tool's schema (jsonschema).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx2 as httpx
import jsonschema
import openai
import pytest

from specmask.orchestrator.api.http.tool_formats import all_triggers
from tests.e2e.stack import ThreadStack

pytestmark = pytest.mark.slow

# Small schemas: the tools are listed in the prompt, and the tiny model's context is 512 tokens.
TOOL_PARAMS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "set_alarm": {
        "type": "object",
        "properties": {"on": {"type": "boolean"}},
        "required": ["on"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOL_PARAMS.items()]

ASK = [{"role": "user", "content": "What is the weather in Paris? Call a tool if you need one."}]


def _check_answer(choice: Any) -> str:
    """The kind of a successful answer ("text" or "calls"), after checking it like a client would."""
    message = choice.message
    if choice.finish_reason == "tool_calls":
        # Text before the calls (Hermes: "Let me check.<tool_call>...") is content, never a call.
        assert message.tool_calls and not any(t in (message.content or "") for t in all_triggers())
        for call in message.tool_calls:
            assert call.id and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), TOOL_PARAMS[call.function.name])
        return "calls"
    assert choice.finish_reason in ("stop", "length")
    assert not message.tool_calls and isinstance(message.content, str)
    return "text"


@pytest.mark.parametrize("tool_choice", ["auto", None])
def test_tools_auto_answers_text_or_valid_calls(
    openai_client: openai.OpenAI, model: str, tool_choice: str | None
) -> None:
    kinds = []
    for seed in range(6):
        kwargs: dict[str, Any] = {} if tool_choice is None else {"tool_choice": tool_choice}
        resp = openai_client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=48, **kwargs
        )
        kinds.append(_check_answer(resp.choices[0]))
    assert set(kinds) <= {"text", "calls"}


def test_tools_auto_streamed_matches_unary(openai_client: openai.OpenAI, model: str) -> None:
    """Same seed, same answer: streamed text arrives as content deltas, calls whole at the end."""
    for seed in (3, 4):
        kwargs: dict[str, Any] = dict(model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=48)
        unary = openai_client.chat.completions.create(**kwargs)
        chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert chunks[-1].choices[0].finish_reason == unary.choices[0].finish_reason
        if _check_answer(unary.choices[0]) == "calls":
            assert [c.function.arguments for c in calls if c.function.arguments is not None] == [
                c.function.arguments for c in unary.choices[0].message.tool_calls
            ]
            assert content == (unary.choices[0].message.content or "")
        else:
            assert not calls and content == unary.choices[0].message.content


def test_tools_none_is_plain_text(openai_client: openai.OpenAI, model: str) -> None:
    resp = openai_client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", temperature=1.0, seed=1, max_tokens=16
    )
    assert _check_answer(resp.choices[0]) == "text"


def test_tools_auto_with_another_constraint_is_refused(openai_client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, response_format={"type": "json_object"}, max_tokens=8
        )
    assert "auto" in exc.value.message and exc.value.body["param"] == "response_format"


def test_json_mode_is_any_object_with_no_schema_in_the_prompt(openai_client: openai.OpenAI, model: str) -> None:
    """JSON mode adds nothing to the caller's prompt (the model saw {"type": "object"} and copied it)."""
    messages = [{"role": "user", "content": "Describe a cat as JSON."}]
    plain = openai_client.chat.completions.create(model=model, messages=messages, temperature=0.0, max_tokens=1)
    for seed in (1, 2):
        resp = openai_client.chat.completions.create(
            model=model,
            messages=messages,
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
            max_tokens=64,
        )
        assert resp.usage.prompt_tokens == plain.usage.prompt_tokens
        choice = resp.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_unknown_fields_are_ignored_and_counted(stack: ThreadStack, openai_client: openai.OpenAI, model: str) -> None:
    """Fields newer SDKs send (and any other unknown field) are ignored, as vLLM does; known
    fields keep their types (a wrong type is still a 400)."""
    assert stack.running is not None
    registry = stack.running.server.metrics.registry

    def counted(name: str) -> float:
        return registry.get_sample_value("specmask_http_unknown_fields_total", {"field": name}) or 0.0

    before = counted("prompt_cache_key")
    resp = openai_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        reasoning_effort="low",
        prompt_cache_key="k1",
        extra_body={"some_framework_field": {"x": 1}},
        max_tokens=4,
    )
    assert resp.choices[0].finish_reason in ("stop", "length")
    # reasoning_effort is known: a chat template variable (a template without it ignores it).
    assert counted("prompt_cache_key") == before + 1 and counted("some_framework_field") >= 1
    assert counted("reasoning_effort") == 0
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], extra_body={"temperature": "hot"}
        )
    assert "temperature" in exc.value.message


def test_http_port_serves_metrics_version_tokenize_and_counts_statuses(
    stack: ThreadStack, openai_client: openai.OpenAI, model: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert stack.running is not None
    root = stack.http_url

    def count(route: str, status: int) -> float:
        sample = stack.running.server.metrics.registry.get_sample_value(  # type: ignore[union-attr]
            "specmask_http_requests_total", {"route": route, "status": str(status)}
        )
        return sample or 0.0

    ok_before, bad_before = count("/v1/chat/completions", 200), count("/v1/chat/completions", 400)
    with caplog.at_level(logging.INFO, logger="specmask.orchestrator.api.http.access"):
        openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=3)
        assert httpx.get(f"{root}/no/such/route").status_code == 404
    assert count("/v1/chat/completions", 200) == ok_before + 1
    assert count("/v1/chat/completions", 400) == bad_before + 1
    assert count("unmatched", 404) >= 1
    lines = [r.getMessage() for r in caplog.records if r.name == "specmask.orchestrator.api.http.access"]
    assert any('"POST /v1/chat/completions" 400' in line for line in lines)
    assert any('"GET /no/such/route" 404' in line for line in lines)

    metrics = httpx.get(f"{root}/metrics").text
    for name in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:generation_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "specmask_http_requests_total",
    ):
        assert name in metrics, name
    assert httpx.get(f"{root}/version").json()["version"]
    tokens = httpx.post(f"{root}/tokenize", json={"model": model, "prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    chat = httpx.post(f"{root}/tokenize", json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
    plain = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert chat.json()["count"] == plain.usage.prompt_tokens
    assert httpx.post(f"{root}/tokenize", json={"model": model}).status_code == 400


# ---- LangChain (langchain-openai), as an application would use it -----------------------------


def test_langchain_bind_tools_default_and_json_mode(stack: ThreadStack, model: str) -> None:
    """``bind_tools`` sends tools without tool_choice ("auto"); ``with_structured_output(method=
    "json_mode")`` sends response_format json_object. Both come back in LangChain's own types."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=stack.http_url + "/v1",
        api_key="unused",
        model=model,
        max_retries=0,
        timeout=300,
        temperature=1.0,
        max_tokens=48,
    )
    for seed in (1, 2):
        answer = llm.bind_tools(TOOLS, seed=seed).invoke(ASK[0]["content"])
        for call in answer.tool_calls:
            jsonschema.validate(call["args"], TOOL_PARAMS[call["name"]])
        finish = answer.response_metadata["finish_reason"]
        if answer.tool_calls:
            assert finish == "tool_calls"
        else:
            assert finish in ("stop", "length") and isinstance(answer.content, str)
    structured = llm.with_structured_output({"title": "cat", "type": "object"}, method="json_mode", include_raw=True)
    try:
        out = structured.invoke("Describe a cat as JSON.")
    except openai.LengthFinishReasonError:
        return  # cut at max_tokens: the SDK raises (this langchain-openai lets it through), never a made-up object
    if out["raw"].response_metadata["finish_reason"] == "stop":
        assert isinstance(out["parsed"], dict) and out["parsing_error"] is None
    else:  # cut at max_tokens: LangChain reports the parse failure, never a made-up object
        assert out["raw"].response_metadata["finish_reason"] == "length" and out["parsed"] is None
