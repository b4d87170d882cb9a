"""Reasoning parsers: the split of an output into reasoning and content, whole and streamed,
the thinking switch of the real Qwen3 template, and the end check of a sectioned grammar."""

from __future__ import annotations

import json
import random

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.orchestrator.api.http import responses as rsp
from specmask.orchestrator.output_check import OutputChecker
from specmask.orchestrator.reasoning import (
    FORMATS,
    Answer,
    ReasoningParser,
    ReasoningStream,
    format_for,
    parse_parser,
    split_answer,
    with_section,
)
from specmask.orchestrator.types import GenerationRequest
from tests.fixtures.shared_data import shared_data_dir

QWEN3 = FORMATS[ReasoningParser.QWEN3]
R1 = FORMATS[ReasoningParser.DEEPSEEK_R1]

OUTPUTS = [
    '<think>a < b, </thin </th</think>\n\n{"a":1}',
    "<think></think>\n\nanswer",
    "<think>cut short while thinking </thi",
    "<think>no gap</think>answer",
    "<think>half a gap</think>\n",
    "no section at all",
    "<thi",
    "",
    "<think>é 😀 </think>\n\n</think> in the answer",
    "thinking</think>\n\nR1 answer",
    "<think>\nR1 with the tag</think>\n\nx",
    "<thi</think>\n\ny",
]


@pytest.mark.parametrize(
    ("fmt", "text", "want"),
    [
        (QWEN3, '<think>a</th b</think>\n\n{"a":1}', Answer("a</th b", '{"a":1}')),
        (QWEN3, "<think>still thinking", Answer("still thinking", None)),
        (QWEN3, "plain answer", Answer(None, "plain answer")),
        (QWEN3, "<think>x</think>y", Answer("x", "y")),  # no grammar: the gap may be missing
        (R1, "thinking</think>\n\nanswer", Answer("thinking", "answer")),
        (R1, "<think>thinking</think>\n\nanswer", Answer("thinking", "answer")),  # the tag is not reasoning
        (R1, "all thinking", Answer("all thinking", None)),
    ],
)
def test_split_answer(fmt, text: str, want: Answer) -> None:
    assert split_answer(fmt, text) == want


@pytest.mark.parametrize("fmt", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
def test_stream_deltas_concatenate_to_the_whole_split(fmt) -> None:
    """Every output cut into random deltas (single characters included): the reasoning and content
    deltas concatenate to split_answer's, and no delta of reasoning holds a closing tag."""
    rng = random.Random(0)
    for text in OUTPUTS:
        want = split_answer(fmt, text)
        for _ in range(60):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            stream = ReasoningStream(fmt)
            thought, content = [], []
            for piece in pieces:
                t, c = stream.feed(piece)
                thought.append(t)
                content.append(c)
                assert fmt.section.close not in t
            t, c = stream.finish()
            thought.append(t)
            content.append(c)
            assert "".join(thought) == (want.reasoning or ""), (text, pieces)
            assert "".join(content) == (want.content or ""), (text, pieces)


def test_parser_names() -> None:
    assert parse_parser("") is None
    assert parse_parser("qwen3") is ReasoningParser.QWEN3
    with pytest.raises(ValueError, match="deepseek_r1"):
        parse_parser("granite")


def test_thinking_switch_only_where_the_template_reads_it() -> None:
    reads = frozenset({"messages", "enable_thinking"})
    assert format_for(None, {"enable_thinking": True}, reads) is None
    assert format_for(ReasoningParser.QWEN3, None, reads) is QWEN3
    assert format_for(ReasoningParser.QWEN3, {"enable_thinking": True}, reads) is QWEN3
    assert format_for(ReasoningParser.QWEN3, {"enable_thinking": False}, reads) is None
    assert format_for(ReasoningParser.QWEN3, {"enable_thinking": 0}, reads) is QWEN3  # Jinja's `is false`: a bool
    # A template that never reads the switch renders thinking on: the section is still expected.
    assert format_for(ReasoningParser.QWEN3, {"enable_thinking": False}, frozenset({"messages"})) is QWEN3
    assert format_for(ReasoningParser.DEEPSEEK_R1, {"enable_thinking": False}, reads) is R1


def test_real_qwen3_template_switch() -> None:
    """The shared Qwen3 template reads enable_thinking, and false closes an empty section in the
    prompt (so no section is expected in the output); on, the model opens it itself."""
    shared = shared_data_dir()
    if shared is None or not (shared / "tokenizers" / "qwen3" / "tokenizer.json").is_file():
        pytest.skip("the Qwen3 tokenizer is not in the shared data")
    from transformers import PreTrainedTokenizerFast

    from specmask.orchestrator.api.http.prompting import TemplatePrompter
    from specmask.orchestrator.api.http.protocol import ChatMessage

    prompter = TemplatePrompter(PreTrainedTokenizerFast.from_pretrained(str(shared / "tokenizers" / "qwen3")))
    assert "enable_thinking" in prompter.template_variables
    messages = [ChatMessage(role="user", content="hi")]
    off = prompter.render(messages, None, {"enable_thinking": False})
    on = prompter.render(messages, None, None)
    assert off.endswith("<think>\n\n</think>\n\n") and on.endswith("assistant\n")
    assert format_for(ReasoningParser.QWEN3, {"enable_thinking": False}, prompter.template_variables) is None


SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('<think>{"n": "not yet"}</think>\n\n{"n":1}', True),
        ('<think></think>\n\n{"n":1}', True),
        ('<think>{"n":1}', False),  # never closed: no content at all
        ('{"n":1}', False),  # no section
        ('<think>x</think>{"n":1}', False),  # no gap
        ('<think>x</think>\n\n{"n":"1"}', False),  # content against the schema
    ],
)
def test_end_check_reads_only_the_content(text: str, ok: bool) -> None:
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA, reasoning=QWEN3.section)
    verdict = OutputChecker().check(spec, text)
    assert verdict.ok is ok, verdict.reason


def test_regex_end_check_with_section() -> None:
    spec = GrammarSpec(GrammarKind.REGEX, "(yes|no)", reasoning=R1.section)
    assert OutputChecker().check(spec, "hmm </thinking> is not the tag</think>\n\nyes").ok
    assert not OutputChecker().check(spec, "hmm</think>\n\nmaybe").ok


def test_with_section_and_response_fields() -> None:
    grammar = GrammarSpec(GrammarKind.REGEX, "a")
    request = GenerationRequest(request_id="r", prompt="p", grammar=grammar)
    assert with_section(request, QWEN3).grammar == GrammarSpec(GrammarKind.REGEX, "a", reasoning=QWEN3.section)
    assert with_section(request, None) is request
    plain = GenerationRequest(request_id="r", prompt="p")
    assert with_section(plain, QWEN3) is plain  # no grammar: nothing to compose, the split still applies
    budgeted = with_section(request, QWEN3, 5).grammar
    assert budgeted is not None and budgeted.reasoning is not None and budgeted.reasoning.max_tokens == 5
    for bad, fmt, req in [(0, QWEN3, request), (1 << 40, QWEN3, request), (5, None, request), (5, QWEN3, plain)]:
        with pytest.raises(ValueError, match="max_reasoning_tokens"):
            with_section(req, fmt, bad)
    message = rsp.with_reasoning({"role": "assistant", "content": ""}, "why", unanswered=True)
    assert message == {"role": "assistant", "content": None, "reasoning": "why", "reasoning_content": "why"}
    assert rsp.reasoning_delta("x") == {"reasoning": "x", "reasoning_content": "x"}
