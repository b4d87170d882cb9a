"""Tool-call markers that are special tokens (Mistral's ``[TOOL_CALLS]``, harmony's ``<|channel|>``
...): admitted by id by the mask service's real xgrammar engine, kept in the output's text as
their text (and no other special token), parsed back, and checked at the end as tokens: a marker
written where the grammar does not name it, or spelled out in ordinary tokens where it does,
fails the end check of a real request, never a success."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, StepOutput
from specmask.mask_service.grammar.backends import BACKENDS
from specmask.mask_service.server.tokenizers import TokenizerRegistry, TokenizerSource
from specmask.orchestrator.api.http.prompting import load_prompter
from specmask.orchestrator.api.http.protocol import Tool
from specmask.orchestrator.api.http.tool_formats import HARMONY, LLAMA3_JSON, MISTRAL, ToolCallFormat
from specmask.orchestrator.api.http.tool_grammar import (
    StreamSplit,
    parse_calls,
    split_calls,
    text_content,
    tool_grammar,
)
from specmask.orchestrator.checked_retry import EndCheck
from specmask.orchestrator.kept_tokens import KeepingDecoder, KeptToken, decoder_for, named_token_ids
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.output_check import OutputChecker
from specmask.orchestrator.request import Request
from specmask.orchestrator.types import GrammarReport
from tests.fixtures.chat_templates import HARMONY_SHORT, MISTRAL_V03, with_template
from tests.fixtures.tokenizers import EOS_TOKEN, HARMONY_SPECIAL, MISTRAL_SPECIAL, with_special_tokens

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}})]
CHECKER = OutputChecker()
PYTHON_TAG = "<|python_tag|>"


@pytest.fixture(scope="module")
def vocab_dir(bpe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test BPE with Mistral's, harmony's and Llama's markers as special tokens."""
    return with_special_tokens(
        bpe_dir, tmp_path_factory.mktemp("markers"), (*MISTRAL_SPECIAL, *HARMONY_SPECIAL, PYTHON_TAG)
    )


@pytest.fixture(scope="module")
def tok(vocab_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(vocab_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def special(tok: Any) -> dict[str, int]:
    return {str(t.content): int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special}


def ids_of(tok: Any, special: dict[str, int], text: str) -> list[int]:
    """``text`` as a model writes it: each special marker as its one token, the rest in ordinary ones."""
    out: list[int] = []
    pos = 0
    while pos < len(text):
        hits = [(text.find(m, pos), m) for m in special if text.find(m, pos) >= 0]
        at, marker = min(hits) if hits else (len(text), "")
        if at > pos:
            out += tok.encode(text[pos:at], add_special_tokens=False).ids
        if marker:
            out.append(special[marker])
        pos = at + len(marker)
    return out


def spelled_ids(tok: Any, special: dict[str, int], text: str) -> list[int]:
    """``text`` in ordinary tokens only: each marker's characters one by one (the tokenizer
    itself would read a marker in the text as its special token)."""
    out: list[int] = []
    for ch in text:
        out += tok.encode(ch, add_special_tokens=False).ids
    assert not set(out) & set(special.values())
    return out


CALLS = {
    MISTRAL: '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    HARMONY: '<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{"city": "Paris"}<|call|>',
}


def test_prompters_read_the_markers_as_special_tokens(vocab_dir: Path, tmp_path: Path, special: dict) -> None:
    for template, fmt in ((MISTRAL_V03, MISTRAL), (HARMONY_SHORT, HARMONY)):
        prompter = load_prompter(str(with_template(vocab_dir, template, tmp_path / fmt.parser.value)))
        assert prompter.tool_format is fmt
        assert all(prompter.special_tokens[m] == special[m] for m in fmt.special_markers)


@pytest.mark.parametrize("fmt", [MISTRAL, HARMONY], ids=lambda f: f.parser.value)
def test_markers_are_tokens_in_the_grammar_and_text_in_the_output(tok: Any, special: dict, fmt: ToolCallFormat) -> None:
    for choice in ("auto", "required"):
        tools = tool_grammar(TOOLS, choice, True, fmt, special)
        assert named_token_ids(tools.grammar) == {special[m] for m in fmt.special_markers}
        for marker in fmt.special_markers:
            assert json.dumps(marker) not in tools.grammar.text  # never spelled out
        ids = ids_of(tok, special, CALLS[fmt])
        decoder = decoder_for(tok, tools.grammar)
        text = decoder.decode([*ids, special[EOS_TOKEN]])  # an EOS after it: dropped, as ever
        assert text == CALLS[fmt]
        kept = decoder.kept(ids)
        assert [k.token_id for k in kept] == [i for i in ids if i in special.values()]
        assert CHECKER.check(tools.grammar, text, tokens=kept).ok
        before, calls = split_calls(text, tools)
        assert before == "" and calls is not None
        [call] = parse_calls(calls, tools, CHECKER)
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        # The same characters in ordinary tokens: not what the grammar admits.
        assert not CHECKER.check(tools.grammar, text).ok
    if fmt is HARMONY:  # a text answer: the final channel's markers are tokens too, never content
        auto = tool_grammar(TOOLS, "auto", True, fmt, special)
        answer = "<|channel|>final<|message|>It is sunny."
        ids = ids_of(tok, special, answer)
        decoder = decoder_for(tok, auto.grammar)
        text = decoder.decode(ids)
        assert CHECKER.check(auto.grammar, text, tokens=decoder.kept(ids)).ok
        assert split_calls(text, auto) == (text, None) and text_content(text, auto) == "It is sunny."


def test_mask_admits_the_marker_token_and_refuses_it_spelled_out(vocab_dir: Path, tok: Any, special: dict) -> None:
    """The mask service's xgrammar engine over this vocabulary: the marker is its one token,
    the same characters in ordinary tokens are refused, and the token is refused in text."""
    registry = TokenizerRegistry([TokenizerSource(str(vocab_dir))])
    info = registry.info(tokenizer_id_for_path(vocab_dir), None)
    engine = BACKENDS["xgrammar"]
    compiler = engine.make_compiler(info, 1)
    stop = special[EOS_TOKEN]

    def walk(compiled: Any, ids: list[int]) -> int | None:
        matcher = engine.new_matcher(compiled)
        for i, t in enumerate(ids):
            if not matcher.accept_token(int(t)):
                return i
        return None if matcher.accept_token(stop) else len(ids)

    for fmt in (MISTRAL, HARMONY):
        compiled = engine.compile(compiler, tool_grammar(TOOLS, "auto", True, fmt, special).grammar)
        assert walk(compiled, ids_of(tok, special, CALLS[fmt])) is None
        cut = walk(compiled, spelled_ids(tok, special, CALLS[fmt]))  # one character a token
        assert cut is not None and cut < len(fmt.special_markers[0]), fmt.parser  # within the first marker
    mistral = engine.compile(compiler, tool_grammar(TOOLS, "auto", True, MISTRAL, special).grammar)
    said = tok.encode("Sure.", add_special_tokens=False).ids
    assert walk(mistral, [*said, *ids_of(tok, special, CALLS[MISTRAL])]) is None  # text, then the calls
    # Inside a JSON string xgrammar reads the token as its text, as it reads every added token:
    # admitted there, and the end check reads it the same way (below).
    inside = ids_of(tok, special, INSIDE)
    assert walk(mistral, inside) is None
    harmony = engine.compile(compiler, tool_grammar(TOOLS, "auto", True, HARMONY, special).grammar)
    stray = ids_of(tok, special, STRAY_HARMONY)
    assert walk(harmony, stray) == stray.index(special["<|call|>"])  # never in the final channel's text


INSIDE = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "[TOOL_CALLS]"}}]'
STRAY_HARMONY = "<|channel|>final<|message|>It is<|call|> sunny."


class _Seen:
    def __init__(self) -> None:
        self.finished: list[tuple[FinishReason, str | None]] = []

    def finish(self, request: Request, reason: FinishReason, error: str | None) -> None:
        request.finish(reason, error)
        self.finished.append((reason, error))


def _end_check(tok: Any, spec: Any, ids: list[int]) -> tuple[str, tuple[FinishReason, str | None]]:
    """A real request that generated ``ids`` under ``spec``, finished through the real end check."""
    seq = NewSequence("r-1", (1, 2), spec, sampling=SamplingParams(temperature=0.7, seed=1))
    request = Request(seq, tokenizer=tok, grammar=GrammarReport(enforcement="exact", backend="xgrammar"))
    request.apply_step(StepOutput("r-1", ids, FinishReason.GRAMMAR_COMPLETE))
    seen = _Seen()

    async def go() -> None:
        end = EndCheck(CHECKER, tok, OrchestratorMetrics(CollectorRegistry()), finish=seen.finish, resample=None)  # type: ignore[arg-type]
        end.finish_checked(request)
        for _ in range(500):
            if seen.finished:
                break
            await asyncio.sleep(0.01)
        await end.stop()

    asyncio.run(go())
    [outcome] = seen.finished
    return request.text, outcome


def test_end_check_of_real_requests_reads_markers_as_tokens(tok: Any, special: dict) -> None:
    tools = tool_grammar(TOOLS, "auto", True, MISTRAL, special)
    good = ids_of(tok, special, CALLS[MISTRAL])
    text, outcome = _end_check(tok, tools.grammar, good)
    assert outcome == (FinishReason.GRAMMAR_COMPLETE, None) and text == CALLS[MISTRAL]
    # The marker token inside an argument: its text, as the mask read it; the call is valid.
    text, outcome = _end_check(tok, tools.grammar, ids_of(tok, special, INSIDE))
    assert outcome == (FinishReason.GRAMMAR_COMPLETE, None) and text == INSIDE
    harmony = tool_grammar(TOOLS, "auto", True, HARMONY, special)
    violations = [
        # The marker token inside the text before the calls, then something that is no call.
        (tools, "Sure [TOOL_CALLS] x[TOOL_CALLS] []"),
        # A harmony marker token in the final channel's text.
        (harmony, STRAY_HARMONY),
        # The calls' marker token twice.
        (tools, "[TOOL_CALLS][TOOL_CALLS] [" + CALLS[MISTRAL].removeprefix("[TOOL_CALLS] [")),
    ]
    for grammar, written in violations:
        _, (reason, error) = _end_check(tok, grammar.grammar, ids_of(tok, special, written))
        assert reason is FinishReason.GRAMMAR_VIOLATION and error and "grammar violation" in error, written
    spelled = spelled_ids(tok, special, CALLS[MISTRAL])  # no special token at all
    _, (reason, _) = _end_check(tok, tools.grammar, spelled)
    assert reason is FinishReason.GRAMMAR_VIOLATION
    # A harmony marker a Mistral grammar never names: dropped from the text as any special token,
    # and the output without it is what is checked (here a valid call).
    stray = [*good[:3], special["<|call|>"], *good[3:]]
    text, outcome = _end_check(tok, tools.grammar, stray)
    assert outcome == (FinishReason.GRAMMAR_COMPLETE, None) and "<|call|>" not in text


def test_python_tag_is_kept_then_read_as_the_calls_opener(tok: Any, special: dict) -> None:
    """Llama's optional <|python_tag|>: the text holds it, the parser reads the calls after it,
    streamed or whole, and no content returned to the client holds it."""
    written = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    for choice in ("auto", "required"):
        tools = tool_grammar(TOOLS, choice, True, LLAMA3_JSON, special)
        ids = [special[PYTHON_TAG], *tok.encode(written, add_special_tokens=False).ids]
        decoder = decoder_for(tok, tools.grammar)
        assert isinstance(decoder, KeepingDecoder)
        text = decoder.decode(ids)
        assert text == PYTHON_TAG + written
        assert CHECKER.check(tools.grammar, text, tokens=decoder.kept(ids)).ok
        assert not CHECKER.check(tools.grammar, text).ok  # the tag's characters are not the tag
        assert split_calls(text, tools) == ("", written)
        for cut in range(len(text) + 1):
            split = StreamSplit(tools)
            content, calls = split.feed(text[:cut])
            more_content, more_calls = split.feed(text[cut:])
            assert (content + more_content, calls + more_calls) == ("", written) and split.calls, cut
        assert text_content(PYTHON_TAG + '{"name": "get_w', tools) == '{"name": "get_w'  # cut short


def test_a_tokenizer_that_does_not_list_its_special_tokens(tok: Any, special: dict) -> None:
    """A decoder that only decodes: the kept tokens' texts are placed between ordinary runs."""

    class Plain:
        def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
            return str(tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    ids = ids_of(tok, special, CALLS[MISTRAL])
    keep = {special["[TOOL_CALLS]"]}
    plain, listed = KeepingDecoder(Plain(), keep), KeepingDecoder(tok, keep)
    assert plain.decode([special["<|call|>"], *ids]) == listed.decode(ids) == CALLS[MISTRAL]
    assert plain.kept(ids) == listed.kept(ids) == (KeptToken(0, special["[TOOL_CALLS]"], "[TOOL_CALLS]"),)
    assert listed.find("a[TOOL_CALLS][TOOL_CALLS]") == (
        KeptToken(1, special["[TOOL_CALLS]"], "[TOOL_CALLS]"),
        KeptToken(13, special["[TOOL_CALLS]"], "[TOOL_CALLS]"),
    )


def test_a_marker_that_is_a_stop_token_ends_the_call(vocab_dir: Path, tok: Any, special: dict, tmp_path: Path) -> None:
    """gpt-oss's generation config names <|call|> a stop token: the engine admits a stop token
    only where the grammar ends, so the harmony call's grammar ends after its arguments and the
    model's <|call|> ends it (not in the text); the other markers are still tokens."""
    served = with_template(vocab_dir, HARMONY_SHORT, tmp_path / "gpt-oss")
    call = special["<|call|>"]
    (served / "generation_config.json").write_text(json.dumps({"eos_token_id": [special[EOS_TOKEN], call]}))
    prompter = load_prompter(str(served))
    assert prompter.tool_format is HARMONY and call in prompter.stop_token_ids
    registry = TokenizerRegistry([TokenizerSource(str(served))])
    info = registry.info(tokenizer_id_for_path(served), None)
    assert call in info.stop_token_ids  # the mask service reads the same stop set
    engine = BACKENDS["xgrammar"]
    compiler = engine.make_compiler(info, 1)
    body = CALLS[HARMONY].removesuffix("<|call|>")
    for choice in ("auto", "required"):
        tools = tool_grammar(TOOLS, choice, True, HARMONY, prompter.special_tokens, prompter.stop_token_ids)
        assert f"Token({call})" not in tools.grammar.text and json.dumps("<|call|>") not in tools.grammar.text
        assert named_token_ids(tools.grammar) == {special[m] for m in HARMONY.special_markers if m != "<|call|>"}
        assert tools.max_calls == 1
        matcher = engine.new_matcher(engine.compile(compiler, tools.grammar))
        ids = ids_of(tok, special, body)
        assert all(matcher.accept_token(int(t)) for t in ids) and matcher.accept_token(call)
        assert matcher.is_terminated()
        decoder = decoder_for(tok, tools.grammar)
        text = decoder.decode([*ids, call])  # the stop token: not in the text
        assert text == body and CHECKER.check(tools.grammar, text, tokens=decoder.kept(ids)).ok
        [parsed] = parse_calls(split_calls(text, tools)[1] or "", tools, CHECKER)
        assert parsed["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # Without the stop set, <|call|> is the grammar's own token again.
    assert f"Token({call})" in tool_grammar(TOOLS, "auto", True, HARMONY, prompter.special_tokens).grammar.text


def test_kept_tokens_after_a_reasoning_section(tok: Any, special: dict) -> None:
    """Behind a reasoning section the end check reads the content's tokens where they are in it;
    a kept token inside the section (which admits none) fails the check."""
    import dataclasses

    from specmask.orchestrator.reasoning import FORMATS, ReasoningParser

    section = FORMATS[ReasoningParser.QWEN3].section
    tools = tool_grammar(TOOLS, "required", True, MISTRAL, special)
    spec = dataclasses.replace(tools.grammar, reasoning=section)
    thought = "<think>call it</think>\n\n"
    ids = ids_of(tok, special, thought + CALLS[MISTRAL])
    decoder = decoder_for(tok, spec)
    text = decoder.decode(ids)
    assert text == thought + CALLS[MISTRAL]
    kept = decoder.kept(ids)
    assert [k.offset for k in kept] == [len(thought)] and CHECKER.check(spec, text, tokens=kept).ok
    inside = "<think>[TOOL_CALLS]</think>\n\n" + CALLS[MISTRAL]
    ids = ids_of(tok, special, inside)
    verdict = CHECKER.check(spec, decoder.decode(ids), tokens=decoder.kept(ids))
    assert not verdict.ok and "reasoning section" in verdict.reason


def test_streamed_content_never_holds_a_marker(special: dict) -> None:
    """Text the grammar would never let through (a marker token in text, then no call): what a
    stream sends as content before the end check fails the output holds no marker either."""
    tools = tool_grammar(TOOLS, "auto", True, MISTRAL, special)
    split = StreamSplit(tools)
    sent = [split.feed(piece)[0] for piece in ("Sure ", "[TOOL_CALLS]", " x", "[TOOL_CALLS]", " ok")]
    assert "".join(sent) + split.pending() == "Sure  x ok" and not split.calls
