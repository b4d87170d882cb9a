"""Tool calls in each model family's own format: the format read from the real chat templates,
the template's own rendering of a past call accepted by the grammar, calls parsed back and
checked, and under tool_choice "auto" a call in another family's format (or hidden in text)
refused token by token by the mask service's real engine on the real Qwen3 vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specmask.common.grammar_spec import GrammarSpec
from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.mask_service.grammar.backends import BACKENDS
from specmask.mask_service.server.tokenizers import TokenizerRegistry, TokenizerSource
from specmask.orchestrator.api.http.prompting import TemplatePrompter, load_prompter
from specmask.orchestrator.api.http.protocol import ChatMessage, NamedToolChoice, Tool
from specmask.orchestrator.api.http.tool_formats import (
    FORMATS,
    HARMONY,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    TEXT_EXCLUSIONS,
    ToolCallFormat,
    ToolCallParser,
    all_triggers,
    detect,
    resolve,
)
from specmask.orchestrator.api.http.tool_grammar import (
    StreamSplit,
    is_call_output,
    parse_calls,
    split_calls,
    tool_grammar,
)
from specmask.orchestrator.kept_tokens import decoder_for
from specmask.orchestrator.output_check import OutputChecker
from tests.fixtures.chat_templates import (
    HARMONY_SHORT,
    LLAMA_31,
    MISTRAL_V03,
    llama31_tokenizer,
    qwen3_template,
    with_template,
)
from tests.fixtures.shared_data import require, shared_data_dir

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}),
    Tool.model_validate({"type": "function", "function": {"name": "stop"}}),
]
CHECKER = OutputChecker()


def calls_text(fmt: ToolCallFormat, *calls: tuple[str, object]) -> str:
    """A tool-call output in ``fmt``, written by hand from the format's published shape."""
    one = [fmt.call_head(name) + json.dumps(args, ensure_ascii=False) + fmt.tail for name, args in calls]
    return fmt.calls_open + fmt.separator.join(one) + fmt.calls_close


# The same call, as each family's model writes it (independent of the registry's strings).
WRITTEN = {
    ToolCallParser.HERMES: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ToolCallParser.LLAMA3_JSON: '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ToolCallParser.MISTRAL: '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    ToolCallParser.HARMONY: (
        '<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    ),
}


@pytest.fixture(scope="module")
def shared() -> Path:
    path = shared_data_dir()
    if path is None:
        pytest.skip("shared data not found (set SPECMASK_SHARED_DATA or provide ../shared/data)")
    return path


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.parser.value)
def test_each_format_admits_its_own_call_and_no_other(fmt: ToolCallFormat) -> None:
    auto = tool_grammar(TOOLS, "auto", True, fmt)
    own = WRITTEN[fmt.parser]
    assert own == calls_text(fmt, ("get_weather", {"city": "Paris"}))
    assert CHECKER.check(auto.grammar, own).ok and is_call_output(own, auto)
    [call] = parse_calls(own, auto, CHECKER)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    for other, text in WRITTEN.items():
        if other is not fmt.parser:
            # Neither a call (wrong format) nor text (a call hidden in content): refused.
            assert not CHECKER.check(auto.grammar, text).ok, (fmt.parser, other)
            assert not CHECKER.check(auto.grammar, fmt.text_open + "Sure. " + text).ok, (fmt.parser, other)
    assert CHECKER.check(auto.grammar, fmt.text_open + "It is sunny in Paris.").ok
    required = tool_grammar(TOOLS, "required", True, fmt)
    assert not CHECKER.check(required.grammar, fmt.text_open + "It is sunny.").ok
    assert CHECKER.check(required.grammar, own).ok


@pytest.mark.parametrize("fmt", [f for f in FORMATS.values() if f.parallel], ids=lambda f: f.parser.value)
def test_parallel_calls_and_their_limits(fmt: ToolCallFormat) -> None:
    two = calls_text(fmt, ("get_weather", {"city": "Oslo", "days": 2}), ("stop", {}))
    auto = tool_grammar(TOOLS, "auto", True, fmt)
    assert CHECKER.check(auto.grammar, two).ok
    calls = parse_calls(two, auto, CHECKER)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "stop"] and calls[0]["id"] != calls[1]["id"]
    single = tool_grammar(TOOLS, "auto", False, fmt)  # parallel_tool_calls: false
    assert not CHECKER.check(single.grammar, two).ok
    with pytest.raises(ValueError, match="at most 1"):
        parse_calls(two, single, CHECKER)
    named = tool_grammar(
        TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "stop"}}), True, fmt
    )
    assert CHECKER.check(named.grammar, calls_text(fmt, ("stop", {}))).ok
    assert not CHECKER.check(named.grammar, calls_text(fmt, ("get_weather", {"city": "x"}))).ok
    with pytest.raises(ValueError, match="none of the tools"):
        parse_calls(calls_text(fmt, ("get_weather", {"city": "x"})), named, CHECKER)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.parser.value)
def test_parse_fails_closed(fmt: ToolCallFormat) -> None:
    auto = tool_grammar(TOOLS, "auto", True, fmt)
    for bad in (
        calls_text(fmt, ("get_weather", {"city": "Oslo", "days": 9})),  # breaks the schema
        calls_text(fmt, ("get_weather", {"town": "Oslo"})),
        calls_text(fmt, ("jump", {})),
        calls_text(fmt, ("stop", [])),  # arguments not an object
        calls_text(fmt, ("stop", {})) + " trailing",
        calls_text(fmt, ("stop", {}))[:-1],
        "plain text",
    ):
        with pytest.raises(ValueError):
            parse_calls(bad, auto, CHECKER)


def test_harmony_text_is_the_final_channel_and_one_call_per_turn() -> None:
    auto = tool_grammar(TOOLS, "auto", True, HARMONY)
    assert auto.max_calls == 1
    assert CHECKER.check(auto.grammar, "<|channel|>final<|message|>Hi there").ok
    assert not CHECKER.check(auto.grammar, "Hi there").ok  # text outside a channel
    split = StreamSplit(auto)
    fed = [split.feed(t) for t in ("<|channel|>", "final<|message|>", "Hi", " there")]
    assert fed == [("", ""), ("", ""), ("Hi", ""), (" there", "")] and not split.calls
    calls = StreamSplit(auto)
    assert calls.feed("<|channel|>commentary to=functions.") == ("", "<|channel|>commentary to=functions.")
    assert calls.calls


def test_empty_parameters_mean_an_object() -> None:
    bare = [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {}}})]
    auto = tool_grammar(bare, "required", True, HERMES)
    assert CHECKER.check(auto.grammar, calls_text(HERMES, ("f", {"a": [1]}))).ok
    assert not CHECKER.check(auto.grammar, calls_text(HERMES, ("f", [1]))).ok


def test_mistral_call_ids_are_nine_alphanumerics() -> None:
    auto = tool_grammar(TOOLS, "auto", True, MISTRAL)
    [call] = parse_calls(WRITTEN[ToolCallParser.MISTRAL], auto, CHECKER)
    assert len(call["id"]) == 9 and call["id"].isalnum()


def test_text_never_starts_like_a_call_nor_holds_a_trigger() -> None:
    # Text without the exclusions holds no trigger; every call starts with a trigger, but
    # Llama's parsers also read any output starting with "{" as a call.
    assert all(any(x in t for x in TEXT_EXCLUSIONS) for t in all_triggers())
    assert all(any(x in f.call_start for x in TEXT_EXCLUSIONS) for f in FORMATS.values())
    assert all(f.text_open[:1] in "<" for f in FORMATS.values())
    for fmt in (HERMES, LLAMA3_JSON, MISTRAL):
        auto = tool_grammar(TOOLS, "auto", True, fmt)
        llama = fmt is LLAMA3_JSON
        for text, ok in (
            ("", True),
            ("  \n", True),
            ("Use <b>bold</b> and [links] and {braces}.", True),
            ("{}", not llama),
            ("  \n{}", not llama),
            ("x {}", True),
            ('  {"name": 1}', False),
            ("[1, 2]", True),
            ("<b>", True),
            ("<tool_cal", True),
            ("[TOOL_CALLS", True),
            ('a {"name"', False),
            ("a <|python_tag|>", False),
            ("<|python_tag|>", False),
            ("a <｜tool▁calls▁begin｜>", False),
            ("a <tool_cal", True),  # a prefix of a trigger is text
            ("a <<tool_call>", False),
            ("<<tool_call>", False),
            ("[[TOOL_CALLS]", False),
            ("é 😀 <tool_call", True),
        ):
            assert CHECKER.check(auto.grammar, text).ok is ok, (fmt.parser, text)
    harmony = tool_grammar(TOOLS, "auto", True, HARMONY)
    for body in ("{}", "[1]", "<b>"):
        assert CHECKER.check(harmony.grammar, HARMONY.text_open + body).ok


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.parser.value)
def test_text_before_calls_where_the_format_has_it(fmt: ToolCallFormat) -> None:
    """Hermes and Mistral parsers split text before the calls off into content; Llama's and
    harmony's read calls only at the start (harmony's text is its final channel)."""
    auto = tool_grammar(TOOLS, "auto", True, fmt)
    calls = calls_text(fmt, ("get_weather", {"city": "Paris"}), ("stop", {}))
    if not fmt.parallel:
        calls = calls_text(fmt, ("get_weather", {"city": "Paris"}))
    mixed = fmt.text_open + "Let me check <b>that</b>.\n" + calls
    assert CHECKER.check(auto.grammar, mixed).ok is fmt.text_before_calls
    assert fmt.text_before_calls is (fmt in (HERMES, MISTRAL))
    if fmt.text_before_calls:
        before, rest = split_calls(mixed, auto)
        assert before == "Let me check <b>that</b>.\n" and rest == calls
        assert parse_calls(rest, auto, CHECKER)[0]["function"]["name"] == "get_weather"
        assert not CHECKER.check(auto.grammar, mixed + " Done.").ok  # nothing after the calls
        required = tool_grammar(TOOLS, "required", True, fmt)
        assert not CHECKER.check(required.grammar, mixed).ok  # text only under "auto"
        # The trigger never overlaps itself, so none can begin in the text and end in the call.
        marker = next(x for x in TEXT_EXCLUSIONS if fmt.call_start.startswith(x))
        assert not any(marker[i:] == marker[: len(marker) - i] for i in range(1, len(marker)))
    else:
        assert split_calls(mixed, auto) == (mixed, None)


def test_detection_from_templates_and_the_flag(shared: Path, tmp_path: Path) -> None:
    """``auto`` reads the template; each template's own rendering of a past call is a call
    the grammar of the detected format accepts (the format strings match the template's)."""
    qwen_dir = require(shared, "tokenizers", "qwen3")
    arguments = {"city": "Paris", "days": 3}
    for name, template, expected in (
        ("qwen3", qwen3_template(shared), HERMES),
        ("llama31", LLAMA_31, LLAMA3_JSON),
        ("mistral", MISTRAL_V03, MISTRAL),
        ("harmony", HARMONY_SHORT, HARMONY),
    ):
        prompter = load_prompter(str(with_template(qwen_dir, template, tmp_path / name)))
        assert isinstance(prompter, TemplatePrompter) and prompter.supports_tools
        assert prompter.tool_format is expected, name
        call = {
            "id": "abcDEF123",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
        }
        history = [
            ChatMessage(role="user", content="Weather in Paris?"),
            ChatMessage.model_validate({"role": "assistant", "content": "", "tool_calls": [call]}),
            ChatMessage.model_validate({"role": "tool", "content": "sunny", "tool_call_id": "abcDEF123"}),
        ]
        rendered = prompter.render(history, TOOLS)
        written = calls_text(expected, ("get_weather", arguments))
        # Mistral's template also writes the call's id into the object: the call up to its arguments.
        assert (
            written if expected is not MISTRAL else written[: -len(expected.tail + expected.calls_close)]
        ) in rendered
        assert CHECKER.check(tool_grammar(TOOLS, "auto", True, expected).grammar, written).ok
        forced = load_prompter(str(tmp_path / name), ToolCallParser.MISTRAL)
        assert forced.tool_format is MISTRAL  # --tool-call-parser overrides the template
    assert detect("{{ '<|start|>assistant<|channel|>final<|message|>' }}") is HARMONY
    assert detect(None) is HERMES and detect("{{ messages }}") is HERMES
    assert resolve("llama3_json", qwen3_template(shared)) is LLAMA3_JSON
    with pytest.raises(ValueError):
        resolve("pythonic", None)


def _walk(engine: Any, compiled: Any, ids: list[int], stop: int) -> int | None:
    """How many tokens of ``ids`` the grammar takes (None: all of them, then the stop token)."""
    matcher = engine.new_matcher(compiled)
    for i, t in enumerate(ids):
        if not matcher.accept_token(int(t)):
            return i
    return None if matcher.accept_token(stop) else len(ids)


@pytest.mark.slow  # the Qwen3 vocabulary's token tables and two compiles: ~30 s on 2 cores
def test_auto_refuses_other_formats_token_by_token_on_qwen3(shared: Path) -> None:
    """The mask service's xgrammar engine over the real Qwen3 vocabulary (where <tool_call> is
    one token): under each format's "auto" grammar, crafted token sequences of another family's
    call, or of text with a call in it, are cut at the token that starts the foreign call."""
    from transformers import AutoTokenizer

    qwen_dir = require(shared, "tokenizers", "qwen3")
    registry = TokenizerRegistry([TokenizerSource(str(qwen_dir))])
    info = registry.info(tokenizer_id_for_path(qwen_dir), None)
    hf = AutoTokenizer.from_pretrained(str(qwen_dir))
    stop = int(info.stop_token_ids[0])
    engine = BACKENDS["xgrammar"]
    compiler = engine.make_compiler(info, 1)
    for fmt in (HERMES, LLAMA3_JSON):
        spec: GrammarSpec = tool_grammar(TOOLS, "auto", True, fmt).grammar
        compiled = engine.compile(compiler, spec)
        own = hf.encode(WRITTEN[fmt.parser], add_special_tokens=False)
        assert _walk(engine, compiled, own, stop) is None, fmt.parser
        assert _walk(engine, compiled, hf.encode("It is sunny.", add_special_tokens=False), stop) is None
        for other, text in WRITTEN.items():
            if other is fmt.parser:
                continue
            for prefix in ("", "Sure. "):
                ids = hf.encode(prefix + text, add_special_tokens=False)
                cut = _walk(engine, compiled, ids, stop)
                assert cut is not None and cut < len(ids), (fmt.parser, other, prefix)
    # The single <tool_call> token opens a Hermes call, after text too, and never text.
    tool_call_id = hf.convert_tokens_to_ids("<tool_call>")
    hermes = engine.compile(compiler, tool_grammar(TOOLS, "auto", True, HERMES).grammar)
    assert _walk(engine, hermes, [tool_call_id], stop) == 1  # accepted, but not an end
    said = hf.encode("Sure.", add_special_tokens=False)
    assert _walk(engine, hermes, [*said, tool_call_id], stop) == len(said) + 1
    mixed = hf.encode("Sure.\n" + WRITTEN[ToolCallParser.HERMES], add_special_tokens=False)
    assert _walk(engine, hermes, mixed, stop) is None
    tail = hf.encode(" Done.", add_special_tokens=False)
    assert _walk(engine, hermes, [*mixed, *tail], stop) == len(mixed)  # nothing after the calls


@pytest.mark.slow  # the Llama 3 vocabulary's token tables and a compile: ~20 s on 2 cores
def test_llama_python_tag_is_admitted_as_its_special_token(shared: Path, tmp_path: Path) -> None:
    """Llama 3.1's ``<|python_tag|>`` is a special token: a model writes it as that one token,
    never as text. The llama3_json grammar admits it, by id, before the calls (and nowhere
    else) on the real Llama 3.1 vocabulary (Llama 3's, with the reserved tokens 3.1 renamed);
    the output's text keeps it, and the calls are read after it."""
    from transformers import AutoTokenizer

    llama_dir = llama31_tokenizer(require(shared, "tokenizers", "llama3"), tmp_path / "llama31")
    prompter = load_prompter(str(llama_dir))
    assert prompter.tool_format is LLAMA3_JSON
    tag = prompter.special_tokens["<|python_tag|>"]
    hf = AutoTokenizer.from_pretrained(str(llama_dir))
    assert tag == hf.convert_tokens_to_ids("<|python_tag|>") and hf.added_tokens_decoder[tag].special
    registry = TokenizerRegistry([TokenizerSource(str(llama_dir))])
    info = registry.info(tokenizer_id_for_path(llama_dir), None)
    stop = int(info.stop_token_ids[0])
    engine = BACKENDS["xgrammar"]
    compiler = engine.make_compiler(info, 1)
    call = hf.encode(WRITTEN[ToolCallParser.LLAMA3_JSON], add_special_tokens=False)
    said = hf.encode("Sure.", add_special_tokens=False)
    other_special = hf.convert_tokens_to_ids("<|eom_id|>")
    for choice in ("auto", "required"):
        tools = tool_grammar(TOOLS, choice, True, LLAMA3_JSON, prompter.special_tokens)
        assert f"Token({tag})" in tools.grammar.text
        compiled = engine.compile(compiler, tools.grammar)
        assert _walk(engine, compiled, [tag, *call], stop) is None
        assert _walk(engine, compiled, call, stop) is None
        assert _walk(engine, compiled, [tag, tag], stop) == 1  # once, before the calls only
        assert _walk(engine, compiled, [tag, *said], stop) == 1
        assert _walk(engine, compiled, [other_special], stop) == 0
        if choice == "auto":
            assert _walk(engine, compiled, said, stop) is None  # text: yes, but never the tag in it
            assert _walk(engine, compiled, [*said, tag], stop) == len(said)
        # The output's text keeps the token the grammar names (kept_tokens.py); the end check
        # reads it as the token, and the calls parse after it.
        decoder = decoder_for(hf, tools.grammar)
        text = decoder.decode([tag, *call])
        assert text == "<|python_tag|>" + WRITTEN[ToolCallParser.LLAMA3_JSON]
        assert CHECKER.check(tools.grammar, text, tokens=decoder.kept([tag, *call])).ok
        assert split_calls(text, tools) == ("", WRITTEN[ToolCallParser.LLAMA3_JSON])
        [parsed] = parse_calls(split_calls(text, tools)[1] or "", tools, CHECKER)
        assert parsed["function"]["name"] == "get_weather"
    # Formats without an optional special marker, and vocabularies without the token: no token.
    assert "Token(" not in tool_grammar(TOOLS, "auto", True, HERMES, prompter.special_tokens).grammar.text
    assert "Token(" not in tool_grammar(TOOLS, "auto", True, LLAMA3_JSON, {}).grammar.text


def test_tool_call_parser_flag_on_every_serving_command() -> None:
    import argparse

    from specmask.orchestrator.dev.launch import add_stack_arguments
    from specmask.orchestrator.main import add_arguments

    orchestrator = ["--mask-service", "127.0.0.1:1", "--target", "t"]  # its required flags
    for add, required in ((add_arguments, orchestrator), (add_stack_arguments, [])):
        parser = argparse.ArgumentParser()
        add(parser)
        assert ToolCallParser(parser.parse_known_args(required)[0].tool_call_parser) is ToolCallParser.AUTO
        chosen = parser.parse_known_args([*required, "--tool-call-parser", "mistral"])[0].tool_call_parser
        assert ToolCallParser(chosen) is ToolCallParser.MISTRAL
        with pytest.raises(SystemExit):
            parser.parse_known_args([*required, "--tool-call-parser", "pythonic"])
