"""Tool calls in each family's own format, round-tripped on the real stack (mask service, Ray
worker, HTTP API) through the openai SDK, LangChain ``bind_tools`` and instructor's
``Mode.TOOLS`` (in an environment of its own: tests/fixtures/instructor_env.py).

The model is a tiny random-initialised one with the real Qwen3 tokenizer and chat template
(Hermes calls, detected from the template). The Llama 3.1, Mistral and harmony formats are
served by more HTTP front doors on the same engine, whose prompters load those families'
templates (over the same tokenizer): the format is the template's, as ``--tool-call-parser
auto`` reads it, and the engine, grammar compilation and end checks are the stack's own. A random model
never decides to call a tool, so the calls are forced (``required`` / named): the output is a
call in the format whatever the model samples, and must come back as valid ``tool_calls``.
Under ``auto`` the answer is text or calls, never a call hidden in text.

Its own package: the stack (and the Ray it starts) is gone before other packages run theirs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from specmask.orchestrator.api.http.app import HttpConfig, HttpFrontDoor
from specmask.orchestrator.api.http.prompting import load_prompter
from specmask.orchestrator.api.http.tool_formats import HARMONY, LLAMA3_JSON, MISTRAL, all_triggers
from specmask.orchestrator.dev.local_stack import StackConfig
from tests.e2e.stack import MAX_BATCH, MAX_QUEUE, ThreadStack
from tests.e2e_tools.weather_tools import ASK, PARAMS, TOOLS, WEATHER, check_arguments, streamed_calls
from tests.fixtures import instructor_env
from tests.fixtures.chat_templates import HARMONY_SHORT, LLAMA_31, MISTRAL_V03, with_template
from tests.fixtures.openai_sdk import openai_sdk, served_model
from tests.fixtures.shared_data import require, shared_data_dir

pytestmark = pytest.mark.slow

FORMATS = ("hermes", "llama3_json", "mistral", "openai")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadStack]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    shared = shared_data_dir()
    if shared is None:
        pytest.skip("shared data not found (set SPECMASK_SHARED_DATA or provide ../shared/data)")
    qwen = require(shared, "tokenizers", "qwen3")
    target, draft = build_tiny_model_pair(
        tmp_path_factory.mktemp("tools-qwen3"), vocab_from=qwen, max_position_embeddings=2048
    )
    config = StackConfig(target_dir=str(target), draft_dir=str(draft), mask_replicas=1, num_workers=1)
    s = ThreadStack(config, max_batch=MAX_BATCH, max_queue=MAX_QUEUE, default_max_tokens=96, http_port=0).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base_urls(stack: ThreadStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """format name -> its front door's /v1 URL (hermes: the stack's own)."""
    assert stack.running is not None
    server = stack.running.server
    target = Path(stack.running.config.target_dir)
    urls = {"hermes": stack.http_url + "/v1"}
    doors = []
    for name, template, fmt in (
        ("llama3_json", LLAMA_31, LLAMA3_JSON),
        ("mistral", MISTRAL_V03, MISTRAL),
        ("openai", HARMONY_SHORT, HARMONY),
    ):
        prompter = load_prompter(str(with_template(target, template, tmp_path_factory.mktemp(name))))
        assert prompter.tool_format is fmt
        config = HttpConfig(host="127.0.0.1", port=0, model_name="tiny", max_model_len=2048)
        door = HttpFrontDoor(config, server.engine, server.metrics, prompter)
        urls[name] = f"http://127.0.0.1:{stack.run(door.start())}/v1"
        doors.append(door)
    yield urls
    for door in doors:
        stack.run(door.stop())


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_and_named_round_trip_through_the_openai_sdk(base_urls: dict[str, str], fmt: str) -> None:
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
            if fmt == "mistral":
                assert all(len(c.id) == 9 and c.id.isalnum() for c in message.tool_calls)
        # The call goes back into the conversation in the template's own format, and the next
        # answer is a call again.
        follow = [
            *ASK,
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"},
        ]
        again = client.chat.completions.create(
            model=model, messages=follow, tools=TOOLS, tool_choice="required", seed=3, max_tokens=160
        )
        assert again.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("fmt", FORMATS)
def test_streamed_calls_arrive_as_vllm_sends_them(base_urls: dict[str, str], fmt: str) -> None:
    with openai_sdk(base_urls[fmt]) as client:
        model = served_model(client)
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
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    calls = streamed_calls(deltas)
    assert calls
    for call in calls.values():
        check_arguments(call["name"], call["arguments"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_is_text_or_calls_never_a_call_in_content(base_urls: dict[str, str], fmt: str) -> None:
    with openai_sdk(base_urls[fmt]) as client:
        model = served_model(client)
        for seed in (5, 6):
            resp = client.chat.completions.create(
                model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=160
            )
            choice = resp.choices[0]
            content = choice.message.content or ""
            # Text (alone, or before the calls where the format has that) holds no call of any format.
            assert not any(t in content for t in all_triggers()), content
            if choice.finish_reason == "tool_calls":
                assert choice.message.tool_calls
                for call in choice.message.tool_calls:
                    check_arguments(call.function.name, call.function.arguments)
                assert not content or fmt in ("hermes", "mistral"), content
            else:
                assert not choice.message.tool_calls
                assert fmt != "llama3_json" or content.lstrip()[:1] != "{", content


@pytest.mark.parametrize("fmt", FORMATS)
def test_langchain_bind_tools_gets_valid_calls(base_urls: dict[str, str], fmt: str) -> None:
    from langchain_openai import ChatOpenAI

    with openai_sdk(base_urls[fmt]) as client:
        model = served_model(client)
    llm = ChatOpenAI(base_url=base_urls[fmt], api_key="unused", model=model, max_retries=0, timeout=300, max_tokens=160)
    answer = llm.bind_tools(TOOLS, tool_choice="required", seed=7).invoke(ASK[0]["content"])
    assert answer.response_metadata["finish_reason"] == "tool_calls" and answer.tool_calls
    for call in answer.tool_calls:
        jsonschema.validate(call["args"], PARAMS[call["name"]])
    named = llm.bind_tools(TOOLS, tool_choice="get_weather", seed=8).invoke(ASK[0]["content"])
    assert [c["name"] for c in named.tool_calls] == ["get_weather"]
    jsonschema.validate(named.tool_calls[0]["args"], WEATHER)


_INSTRUCTOR_TOOLS = r"""
import json, sys
from typing import Literal

import instructor
import openai
from pydantic import BaseModel, Field

urls = json.loads(sys.argv[1])


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    celsius: int = Field(ge=-90, le=60)  # bounded: a tiny random model may not stop digits


out = {"instructor": instructor.__version__, "openai": openai.__version__}
for fmt, url in urls.items():
    raw = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    model = raw.models.list().data[0].id
    client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
    ask = dict(
        model=model, max_retries=0, max_tokens=150, temperature=1.0,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    try:
        w = client.chat.completions.create(response_model=Weather, seed=11, **ask)
        # Streamed: instructor rebuilds the object from the streamed tool-call deltas.
        partials = list(client.chat.completions.create_partial(response_model=Weather, seed=12, **ask))
    except Exception as exc:  # the completion instructor refused, for the test's message
        sys.exit(f"{fmt}: {exc!r}: {getattr(exc, 'last_completion', None)!r}"[:4000])
    out[fmt] = {"create": w.model_dump(), "partial": partials[-1].model_dump() if partials else None}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def instructor_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    python, why = instructor_env.build(tmp_path_factory.mktemp("instructor-venv"))
    if python is None:
        pytest.skip(why)
    return python


def test_instructor_tools_mode_in_each_format(base_urls: dict[str, str], instructor_python: Path) -> None:
    """instructor's ``Mode.TOOLS`` (a forced call to a tool made from the response model), plain
    and streamed (``create_partial``): in every format the object validates on the first try."""
    proc = instructor_env.run(instructor_python, _INSTRUCTOR_TOOLS, json.dumps(base_urls))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for fmt in FORMATS:
        for way in ("create", "partial"):
            weather = out[fmt][way]
            assert weather is not None and weather["city"] in ("Paris", "Oslo"), (fmt, way, out)
            assert isinstance(weather["celsius"], int) and -90 <= weather["celsius"] <= 60, (fmt, way, out)


def test_streamed_auto_logprobs_follow_the_content(base_urls: dict[str, str]) -> None:
    """Under ``auto`` with logprobs, streamed or not, the content's logprob entries spell the
    content exactly (text held while it could begin a call keeps its tokens with it; call tokens
    are never content's). Hermes: text may come before calls. (The stack's own front door: the
    other formats' doors have no tokenizer, so no logprobs.)"""
    with openai_sdk(base_urls["hermes"]) as client:
        model = served_model(client)
        for seed in (21, 22, 23):
            ask: dict[str, Any] = dict(
                model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=60, logprobs=True
            )
            whole = client.chat.completions.create(**ask).choices[0]
            entries = (whole.logprobs.content or []) if whole.logprobs else []
            assert bytes(b for e in entries for b in (e.bytes or [])).decode() == (whole.message.content or "")
            content, spelled = [], []
            for chunk in client.chat.completions.create(**ask, stream=True):
                if not chunk.choices:
                    continue
                content.append(chunk.choices[0].delta.content or "")
                lp = chunk.choices[0].logprobs
                spelled += [bytes(e.bytes or []) for e in (lp.content or [])] if lp else []
            assert b"".join(spelled).decode() == "".join(content) == (whole.message.content or "")
