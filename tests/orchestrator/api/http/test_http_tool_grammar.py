"""tool_choice "auto" in the Hermes format: the "text or calls" grammar (checked with a fresh xgrammar matcher, as the
engine's end check does), parsing calls back with each call's arguments checked against its own
tool's schema, the request translation, and unknown request fields (ignored, logged, counted)."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client import CollectorRegistry

from specmask.common.grammar_spec import GrammarKind
from specmask.orchestrator.api.http import translate
from specmask.orchestrator.api.http.lenient import MAX_NAMED_FIELDS, OTHER, UnknownFieldLog, unknown_fields
from specmask.orchestrator.api.http.prompting import TranscriptPrompter
from specmask.orchestrator.api.http.protocol import ChatCompletionRequest, Tool
from specmask.orchestrator.api.http.tool_formats import HERMES
from specmask.orchestrator.api.http.tool_grammar import (
    StreamSplit,
    is_call_output,
    parse_calls,
    split_calls,
    tool_grammar,
)
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.output_check import OutputChecker

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
POINT = {
    "type": "object",
    "properties": {"p": {"$ref": "#/$defs/pt"}},
    "required": ["p"],
    "$defs": {"pt": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}},
}
TOOLS = [
    Tool.model_validate({"type": "function", "function": {"name": "weather", "parameters": WEATHER}}),
    Tool.model_validate({"type": "function", "function": {"name": "move", "parameters": POINT}}),
    Tool.model_validate({"type": "function", "function": {"name": "stop"}}),
]
CHECKER = OutputChecker()


def _call(name: str, arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.mark.parametrize(
    ("text", "single", "parallel"),
    [
        ("", True, True),
        ("It is sunny.", True, True),
        ("Let me see <b>bold</b> later is text", True, True),
        ("Let me see <tool_call> later", False, False),  # a call hidden in text: never content
        ('{"name": "stop", "parameters": {}}', False, False),  # another format's call
        ('[TOOL_CALLS] [{"name": "stop", "arguments": {}}]', False, False),
        ('Sure. {"name": "stop", "parameters": {}}', False, False),
        (_call("weather", {"city": "Paris", "days": 3}), True, True),
        (_call("move", {"p": [1, 2]}), True, True),
        (_call("stop", {}), True, True),
        (_call("stop", {}) + "\n" + _call("move", {"p": [3, 4]}), False, True),
        ("\n".join([_call("stop", {})] * 5), False, False),  # more than MAX_PARALLEL_CALLS
        (_call("weather", {"city": "Rome", "days": 3}), False, False),
        (_call("weather", {"city": "Paris"}), False, False),
        (_call("move", {"p": [1]}), False, False),
        (_call("jump", {}), False, False),
        (_call("stop", {}) + " trailing", False, False),
        ("<b>bold</b>", True, True),  # starts with "<", yet is no Hermes call
        ('{"city": "Paris"} and [1, 2]', True, True),
        ('<tool_call>\n{"name": "stop", "arguments": {}', False, False),
        # Text, then calls ("Let me check."), as Qwen3 models write them; nothing after them.
        ("Let me check." + _call("stop", {}), True, True),
        ("Let me check.\n" + _call("stop", {}) + "\n" + _call("move", {"p": [3, 4]}), False, True),
        ("<b>See</b>\n" + _call("stop", {}), True, True),
        ("a <tool_cal" + _call("stop", {}), True, True),  # a trigger's prefix, then the call
        ("Sure. " + _call("stop", {}) + "\nDone.", False, False),
        (_call("stop", {}) + "\nThen " + _call("stop", {}), False, False),
        ("Sure. " + _call("weather", {"city": "Rome", "days": 3}), False, False),
    ],
)
def test_auto_grammar_admits_text_or_valid_calls(text: str, single: bool, parallel: bool) -> None:
    for allow_parallel, expected in ((False, single), (True, parallel)):
        grammar = tool_grammar(TOOLS, "auto", allow_parallel).grammar
        assert grammar.kind is GrammarKind.EBNF
        assert CHECKER.check(grammar, text).ok is expected, (allow_parallel, text)


def test_parse_calls_checks_each_call_against_its_tool() -> None:
    auto = tool_grammar(TOOLS, "auto", True)
    text = _call("stop", {}) + "\n" + _call("weather", {"city": "Oslo", "days": 7})
    assert is_call_output(text, auto) and not is_call_output("Hi <tool_call>", auto)
    calls = parse_calls(text, auto, CHECKER)
    assert [c["function"]["name"] for c in calls] == ["stop", "weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo", "days": 7}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # The grammar's end check and this one are independent: a call breaking its schema is refused
    # here even if a grammar had let it through (days out of range).
    for bad in (
        _call("weather", {"city": "Oslo", "days": 9}),
        _call("nope", {}),
        "plain text",
        _call("stop", {}) + "\n\n" + _call("stop", {}),
    ):
        with pytest.raises(ValueError):
            parse_calls(bad, auto, CHECKER)


def test_translate_auto_and_default_choice() -> None:
    tools = [t.model_dump(exclude_none=True) for t in TOOLS]
    for extra in ({}, {"tool_choice": "auto"}):
        body = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, **extra}
        )
        out = translate.chat_request(body, "r", TranscriptPrompter())
        assert out.tools is not None and out.tools.text_allowed and out.tools.format is HERMES
        assert out.request.grammar == out.tools.grammar
        # A template without tool support gets the tools and the call format in a system turn.
        assert isinstance(out.request.prompt, str) and out.request.prompt.startswith(
            'system: Tools, called as <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>:\n- weather:'
        )
        assert '"name": "weather"' not in out.request.prompt and "- weather:" in out.request.prompt
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "none"}
    )
    none = translate.chat_request(body, "r", TranscriptPrompter())
    assert none.tools is None and none.request.grammar is None


def test_unknown_fields_are_ignored_logged_once_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi", "annotations": []}, {"role": "user", "content": "x"}],
            "safety_identifier": "u1",
            "prompt_cache_key": "k",
            "temperature": 0.5,
        }
    )
    assert sorted(unknown_fields(body)) == ["messages[].annotations", "prompt_cache_key", "safety_identifier"]
    metrics = OrchestratorMetrics(CollectorRegistry())
    log = UnknownFieldLog(metrics.http_unknown_fields)
    with caplog.at_level(logging.WARNING, logger="specmask.orchestrator.api.http.lenient"):
        log.note(body, "r1")
        log.note(body, "r2")
    assert sum("safety_identifier" in r.getMessage() for r in caplog.records) == 1
    assert metrics.registry.get_sample_value("specmask_http_unknown_fields_total", {"field": "safety_identifier"}) == 2
    for i in range(MAX_NAMED_FIELDS + 3):
        log.note(ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user"}], f"f{i}": 1}), "r")
    assert metrics.registry.get_sample_value("specmask_http_unknown_fields_total", {"field": OTHER}) >= 3
    # Known fields stay strictly typed.
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user"}], "temperature": "hot"})


def test_auto_refuses_a_tool_schema_the_mask_service_refuses() -> None:
    from specmask.orchestrator.api.http.errors import ApiError

    bad = Tool.model_validate(
        {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "minProperties": "two"}}}
    )
    with pytest.raises(ApiError) as exc:
        tool_grammar([bad], "auto", parallel=False)
    assert exc.value.param == "tools" and "'bad'" in exc.value.message


def test_stream_split_sends_text_and_holds_the_calls() -> None:
    auto = tool_grammar(TOOLS, "auto", True)
    text = StreamSplit(auto)
    # An end that could begin a call is held until the next text decides it.
    fed = [text.feed(t) for t in ("Hi", " <b>", "<tool_c", "all> x", "<tool_call>")]
    assert fed == [("Hi", ""), (" <b>", ""), ("", ""), ("<tool_call> x", ""), ("", "")]
    assert not text.calls and text.pending() == "<tool_call>" and text.holding == len("<tool_call>")
    calls = StreamSplit(auto)
    fed = [calls.feed(t) for t in ("<tool", "_call>\n", '{"name": "st', "op")]
    assert fed == [("", ""), ("", ""), ("", '<tool_call>\n{"name": "st'), ("", "op")]
    assert calls.calls
    # Text, then the calls' start in the same piece: the text is sent, the rest held.
    mixed = StreamSplit(auto)
    assert mixed.feed("Let me <tool") == ("Let me ", "") and mixed.holding == len("<tool")
    assert mixed.feed('_call>\n{"name": "stop", "arguments": {}}') == (
        "",
        '<tool_call>\n{"name": "stop", "arguments": {}}',
    )
    assert mixed.calls and mixed.feed("\n</tool_call>") == ("", "\n</tool_call>")
    late = StreamSplit(auto)
    assert [late.feed(t) for t in ("<", "b>")] == [("", ""), ("<b>", "")] and not late.calls
    assert StreamSplit(tool_grammar(TOOLS, "required", True)).feed("<") == ("", "<")
    assert StreamSplit(None).feed("<") == ("<", "")


def test_text_before_calls_is_their_content() -> None:
    auto = tool_grammar(TOOLS, "auto", True)
    one = _call("stop", {})
    assert split_calls("Let me check.\n" + one, auto) == ("Let me check.\n", one)
    assert split_calls(one, auto) == ("", one)
    assert split_calls("a <tool_cal" + one, auto) == ("a <tool_cal", one)
    assert split_calls("plain <tool_call", auto) == ("plain <tool_call", None)
    required = tool_grammar(TOOLS, "required", True)
    assert split_calls("Sure. " + one, required) == ("", "Sure. " + one)  # no text: parse_calls refuses it
    with pytest.raises(ValueError):
        parse_calls("Sure. " + one, required, CHECKER)


def test_auto_grammar_keeps_non_ascii_literals() -> None:
    """The tool grammar embeds xgrammar's printed JSON-schema grammar: "façade" prints as "fa\\xe7ade",
    which would read back as U+E7ADE unless the escape is rewritten."""
    params = {"type": "object", "properties": {"c": {"enum": ["façade", "Ñandú"]}}, "required": ["c"]}
    tools = [Tool.model_validate({"type": "function", "function": {"name": "pick", "parameters": params}})]
    grammar = tool_grammar(tools, "auto", parallel=False).grammar
    good = "<tool_call>\n" + json.dumps({"name": "pick", "arguments": {"c": "façade"}}, ensure_ascii=False)
    good += "\n</tool_call>"
    assert CHECKER.check(grammar, good).ok
    assert not CHECKER.check(grammar, good.replace("façade", "fa\U000e7ade")).ok
