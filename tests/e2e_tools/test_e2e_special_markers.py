"""Mistral's and harmony's markers as the special tokens of the served vocabulary, on the real stack
(mask service, Ray worker, HTTP API) through the openai SDK.

The model is a tiny random-initialised one whose tokenizer (the test BPE) holds ``[TOOL_CALLS]``
and harmony's ``<|channel|>``, ``<|constrain|>``, ``<|message|>``, ``<|call|>`` as special
tokens, as those families' vocabularies do; front doors with the Mistral v0.3 and harmony
templates serve it. A forced call (``required`` / named) comes back as ``tool_calls`` that
validate against the tool's schema, whole and streamed, with each marker generated as its one
token (the grammar names it by id); under ``auto`` no content ever holds a marker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from specmask.orchestrator.api.http.app import HttpConfig, HttpFrontDoor
from specmask.orchestrator.api.http.prompting import load_prompter
from specmask.orchestrator.api.http.tool_formats import HARMONY, MISTRAL, ToolCallFormat
from specmask.orchestrator.dev.local_stack import StackConfig
from tests.e2e.stack import MAX_BATCH, MAX_QUEUE, ThreadStack
from tests.e2e_tools.weather_tools import ASK, TOOLS, check_arguments, streamed_calls
from tests.fixtures.chat_templates import HARMONY_SHORT, MISTRAL_V03, with_template
from tests.fixtures.openai_sdk import openai_sdk, served_model
from tests.fixtures.tokenizers import HARMONY_SPECIAL, MISTRAL_SPECIAL, build_bpe_tokenizer, with_special_tokens

pytestmark = pytest.mark.slow

FORMATS: dict[str, tuple[str, ToolCallFormat]] = {"mistral": (MISTRAL_V03, MISTRAL), "openai": (HARMONY_SHORT, HARMONY)}
MARKERS = (*MISTRAL_SPECIAL, *HARMONY_SPECIAL)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadStack]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    base = build_bpe_tokenizer(tmp_path_factory.mktemp("markers-bpe"))
    vocab = with_special_tokens(base, tmp_path_factory.mktemp("markers-vocab"), MARKERS)
    target, draft = build_tiny_model_pair(
        tmp_path_factory.mktemp("markers-model"), vocab_from=vocab, max_position_embeddings=2048
    )
    config = StackConfig(target_dir=str(target), draft_dir=str(draft), mask_replicas=1, num_workers=1)
    s = ThreadStack(config, max_batch=MAX_BATCH, max_queue=MAX_QUEUE, default_max_tokens=96, http_port=0).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base_urls(stack: ThreadStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """format name -> its front door's /v1 URL."""
    assert stack.running is not None
    server = stack.running.server
    target = Path(stack.running.config.target_dir)
    urls, doors = {}, []
    for name, (template, fmt) in FORMATS.items():
        prompter = load_prompter(str(with_template(target, template, tmp_path_factory.mktemp(name))))
        assert prompter.tool_format is fmt and all(m in prompter.special_tokens for m in fmt.special_markers)
        config = HttpConfig(host="127.0.0.1", port=0, model_name="tiny", max_model_len=2048)
        door = HttpFrontDoor(config, server.engine, server.metrics, prompter)
        urls[name] = f"http://127.0.0.1:{stack.run(door.start())}/v1"
        doors.append(door)
    yield urls
    for door in doors:
        stack.run(door.stop())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forced_calls_round_trip_with_marker_tokens(base_urls: dict[str, str], fmt: str) -> None:
    with openai_sdk(base_urls[fmt]) as client:
        model = served_model(client)
        for seed, choice in ((1, "required"), (2, {"type": "function", "function": {"name": "get_weather"}})):
            resp = client.chat.completions.create(
                model=model, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed, max_tokens=160
            )
            message = resp.choices[0].message
            assert resp.choices[0].finish_reason == "tool_calls", message
            assert message.content is None and message.tool_calls
            for call in message.tool_calls:
                check_arguments(call.function.name, call.function.arguments)
            if choice != "required":
                assert [c.function.name for c in message.tool_calls] == ["get_weather"]
        # Streamed: each call's id and name, then its arguments, as vLLM sends them.
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=ASK,
                tools=TOOLS,
                tool_choice="required",
                temperature=1.0,
                seed=4,
                max_tokens=160,
                stream=True,
            )
        )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(m in (delta.content or "") for delta in deltas for m in MARKERS)
    calls = streamed_calls(tc for delta in deltas for tc in (delta.tool_calls or []))
    assert calls
    for call in calls.values():
        check_arguments(call["name"], call["arguments"])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_auto_content_never_holds_a_marker(base_urls: dict[str, str], fmt: str) -> None:
    with openai_sdk(base_urls[fmt]) as client:
        model = served_model(client)
        for seed in (5, 6, 7):
            for max_tokens in (160, 12):  # 12: a call may be cut short, and comes back as content
                resp = client.chat.completions.create(
                    model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=max_tokens
                )
                choice = resp.choices[0]
                content = choice.message.content or ""
                assert not any(m in content for m in MARKERS), (fmt, seed, content)
                if choice.finish_reason == "tool_calls":
                    for call in choice.message.tool_calls or []:
                        check_arguments(call.function.name, call.function.arguments)
