"""A reasoning section composed in front of a caller's grammar (grammar/sections.py).

The section's language is checked against a direct definition (open, text without
close, close, gap) on every string over a small alphabet up to a length, for the
EBNF (xgrammar) and the regex (llguidance's terminal); then whole outputs walk the
composed grammar token by token on both engines, and the caller's grammar is
refused under a section exactly as alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from typing import Any

import pytest
import xgrammar as xgr

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.reasoning_section import ReasoningSection, split_output
from specmask.mask_service.convert import grammar_from_proto, grammar_to_proto
from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.backends import SelectingBackend
from specmask.mask_service.grammar.sections import section_ebnf, section_regex

QWEN3 = ReasoningSection("<think>", "</think>", "\n\n")
R1 = ReasoningSection("", "</think>", "\n\n")
SHORT = ReasoningSection("[", "<a>", "")  # a short close, so every boundary case fits in a few characters


def _in_section(section: ReasoningSection, text: str) -> bool:
    """The definition: the whole text is open + body + close + gap, the body free of close."""
    if not (text.startswith(section.open) and text.endswith(section.close + section.gap)):
        return False
    body = text[len(section.open) : len(text) - len(section.close) - len(section.gap)]
    return len(text) >= len(section.open) + len(section.close) + len(section.gap) and section.close not in body


def _xgrammar_accepts(compiled: Any, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return bool(matcher.accept_string(text.encode("utf-8"))) and bool(matcher.is_terminated())


@pytest.mark.parametrize("section", [SHORT, ReasoningSection("", "<a>", "\n")], ids=["open", "no-open"])
def test_section_language_exhaustive(section: ReasoningSection) -> None:
    """Every string over the tags' characters and "x" up to length 7: the EBNF and the regex
    accept exactly the strings of the definition."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1, cache_enabled=False)
    compiled = compiler.compile_grammar(section_ebnf(section))
    pattern = re.compile(section_regex(section))
    alphabet = "".join(dict.fromkeys(section.open + section.close + section.gap + "x"))  # 5 characters
    seen = accepted = 0
    for n in range(8):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            want = _in_section(section, text)
            assert _xgrammar_accepts(compiled, text) == want, repr(text)
            assert (pattern.fullmatch(text) is not None) == want, repr(text)
            seen += 1
            accepted += want
    assert accepted > 50 and seen > accepted * 10  # both answers were exercised


def test_qwen3_section_samples() -> None:
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1, cache_enabled=False)
    compiled = compiler.compile_grammar(section_ebnf(QWEN3))
    pattern = re.compile(section_regex(QWEN3))
    for text in [
        "<think></think>\n\n",
        "<think>a < b, </thin </thinks </th<</think>\n\n",
        "<think>é 😀 \u2028 </ think></think>\n\n",
        "<think>x</think>y</think>\n\n",
        "<think>x</think>\n",
        "<think>x</think>\n\n\n",
        "x</think>\n\n",
        "<think><think></think>\n\n",
    ]:
        want = _in_section(QWEN3, text)
        assert _xgrammar_accepts(compiled, text) == want, repr(text)
        assert (pattern.fullmatch(text) is not None) == want, repr(text)


def test_split_output_reads_the_grammar_split() -> None:
    split = split_output(QWEN3, '<think>a</th b</think>\n\n{"a":1}')
    assert split is not None and split.closed and split.reasoning == "a</th b" and split.content == '{"a":1}'
    unclosed = split_output(QWEN3, "<think>still thinking")
    assert unclosed is not None and not unclosed.closed and unclosed.content == ""
    no_gap = split_output(QWEN3, '<think>a</think>{"a":1}')
    assert no_gap is not None and not no_gap.closed
    assert split_output(QWEN3, '{"a":1}') is None
    r1 = split_output(R1, "thinking</think>\n\nanswer")
    assert r1 is not None and r1.closed and (r1.reasoning, r1.content) == ("thinking", "answer")


def test_section_must_be_exact_to_build() -> None:
    with pytest.raises(ValueError):
        ReasoningSection("<think>", "", "")
    with pytest.raises(ValueError):
        ReasoningSection("", "<a<", "")  # its first character again: the run construction would not be exact
    with pytest.raises(TypeError):
        GrammarSpec(GrammarKind.REGEX, "a", reasoning=("<think>", "</think>"))  # type: ignore[arg-type]


def test_spec_round_trips_and_keys_apart() -> None:
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type":"integer"}', reasoning=QWEN3)
    assert grammar_from_proto(grammar_to_proto(spec)) == spec
    assert grammar_from_proto(grammar_to_proto(spec.without_reasoning())).reasoning is None
    keys = {
        spec.cache_key(),
        spec.without_reasoning().cache_key(),
        GrammarSpec(spec.kind, spec.text, reasoning=R1).cache_key(),
    }
    assert len(keys) == 3


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
CASES: list[tuple[str, GrammarSpec, str, str]] = [
    # (id, caller's grammar, an answer it accepts, an answer it refuses)
    ("json_schema", GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)), '{"n":12}', '{"m":1}'),
    ("any_json", GrammarSpec(GrammarKind.ANY_JSON), '[1,"</think>"]', "[1,"),
    ("regex", GrammarSpec(GrammarKind.REGEX, r"(yes|no)\.?"), "no.", "maybe"),
    ("ebnf", GrammarSpec(GrammarKind.EBNF, 'root ::= "a"+ "!"'), "aaa!", "!"),
    ("lark", GrammarSpec(GrammarKind.LARK, 'start: "x" NUM\nNUM: /[0-9]+/'), "x42", "x"),
]


def _walk(backend: SelectingBackend, compiled: Any, token_ids: list[int], stop: int) -> bool:
    matcher = backend.new_matcher(compiled)
    return all(matcher.accept_token(t) for t in token_ids) and bool(matcher.accept_token(stop))


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
@pytest.mark.parametrize(("name", "spec", "good", "bad"), CASES, ids=[c[0] for c in CASES])
def test_composed_grammar_walks_tokens(
    registry: Any, bpe_id: str, hf_tok: Any, engine: str, name: str, spec: GrammarSpec, good: str, bad: str
) -> None:
    """A real tokenizer's tokens: thinking (with near-closes and JSON-looking text) then the answer
    ends the grammar; the same answer without the section, a wrong answer, or an unclosed section
    does not. A caller's Lark text under llguidance is refused with a reason, never composed loosely."""
    info = registry.info(bpe_id, None)
    stop = int(info.stop_token_ids[0])
    backend = SelectingBackend()
    compilers = backend.make_compiler(info, 1)
    spec = GrammarSpec(spec.kind, spec.text, backend=engine, reasoning=QWEN3)
    if engine == "llguidance" and spec.kind in (GrammarKind.EBNF, GrammarKind.LARK):
        with pytest.raises(GrammarError):
            backend.compile(compilers, spec)
        return
    compiled = backend.compile(compilers, spec)
    assert compiled.backend == engine

    def tokens(text: str) -> list[int]:
        return list(hf_tok.encode(text, add_special_tokens=False))

    thinking = '<think>Let me see: {"n": "x"} </thin < / think>\n'
    assert _walk(backend, compiled, tokens(f"{thinking}</think>\n\n{good}"), stop)
    assert not _walk(backend, compiled, tokens(good), stop)
    assert not _walk(backend, compiled, tokens(f"{thinking}</think>\n\n{bad}"), stop)
    assert not _walk(backend, compiled, tokens(f"{thinking} {good}"), stop)
    assert not _walk(backend, compiled, tokens(f"{thinking}</think>{good}"), stop)


def test_caller_grammar_refused_as_alone(registry: Any, bpe_id: str) -> None:
    """Behind the section's first row an empty caller language is invisible to the first-row check;
    the caller's grammar is compiled alone first, so it is refused with the same message."""
    backend = SelectingBackend()
    compilers = backend.make_compiler(registry.info(bpe_id, None), 1)
    for spec in [
        GrammarSpec(GrammarKind.REGEX, "a{0}"),  # only the empty string
        GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "integer", "minimum": 3, "maximum": 1})),
        GrammarSpec(GrammarKind.REGEX, "(unclosed"),
    ]:
        with pytest.raises(GrammarError) as alone:
            backend.compile(compilers, spec)
        with pytest.raises(GrammarError) as composed:
            backend.compile(compilers, GrammarSpec(spec.kind, spec.text, reasoning=QWEN3))
        assert composed.value.message == alone.value.message


def test_section_budget_forces_the_end(registry: Any, bpe_id: str, hf_tok: Any) -> None:
    """After max_tokens tokens in the section, a row allows only tokens that spell the rest of it
    (from the part of the closing tag already written), the matcher refuses any other token, the
    answer after it is the grammar's again, and rollback restores the count."""
    import numpy as np

    from specmask.mask_service.grammar.json_keys import engine_matcher, key_vocab
    from specmask.mask_service.grammar.section_budget import SectionBudget

    info = registry.info(bpe_id, None)
    words = (int(info.vocab_size) + 31) // 32
    vocab = key_vocab(bpe_id, info, words)
    backend = SelectingBackend()
    opening = len(hf_tok.encode("<think>", add_special_tokens=False))
    section = ReasoningSection("<think>", "</think>", "\n\n", max_tokens=opening + 4)
    spec = GrammarSpec(GrammarKind.REGEX, "(yes|no)", reasoning=section)
    compiled = backend.compile(backend.make_compiler(info, 1), spec)

    def budget() -> SectionBudget:
        return SectionBudget(backend.new_matcher(compiled), section, vocab.all_bytes, vocab.by_bytes, words)

    def row(m: SectionBudget) -> set[int]:
        out = np.zeros((1, words), dtype=np.int32)
        m.fill_next_token_bitmask(out, 0)
        bits = np.unpackbits(out[0].view(np.uint8), bitorder="little")
        return {int(t) for t in np.flatnonzero(bits)}

    def spelled(ids: set[int]) -> set[bytes]:
        return {vocab.all_bytes[t] for t in ids}

    tokens = hf_tok.encode("<think>one two three four five six seven", add_special_tokens=False)
    assert len(tokens) > section.max_tokens + 1
    m = budget()
    assert all(m.accept_token(t) for t in tokens[: section.max_tokens])
    rest = b"".join(vocab.all_bytes[t] for t in tokens[: section.max_tokens])
    assert b"</think>" not in rest
    allowed = spelled(row(m))
    assert allowed and all(b"</think>\n\n".startswith(b) for b in allowed), allowed
    assert not m.accept_token(tokens[section.max_tokens])  # a free token past the budget
    assert engine_matcher(m) is not m  # forced bytes read the engine under the guard
    # Close it one byte-token at a time where possible, then answer.
    for b in [b"</think>", b"\n\n"]:
        for ch in b:
            ids = [t for t in vocab.by_bytes.get(bytes([ch]), [])]
            assert ids and m.accept_token(ids[0]), bytes([ch])
    assert all(m.accept_token(t) for t in hf_tok.encode("yes", add_special_tokens=False))
    assert m.accept_token(int(info.stop_token_ids[0]))
    # Rolled back into the section, the budget applies again; before it, free text is fine.
    m = budget()
    assert all(m.accept_token(t) for t in tokens[: section.max_tokens])
    m.rollback(1)
    assert m.accept_token(tokens[section.max_tokens - 1]) and not m.accept_token(tokens[section.max_tokens])
    m.rollback(2)
    assert m.accept_token(tokens[section.max_tokens - 2])  # one under the budget: one more free token
    # Spent inside the opening tag: the rest of the tag, then the closing tag, follow.
    short = ReasoningSection("<think>", "</think>", "\n\n", max_tokens=1)
    m = SectionBudget(
        backend.new_matcher(
            backend.compile(backend.make_compiler(info, 1), GrammarSpec(GrammarKind.REGEX, "(yes|no)", reasoning=short))
        ),
        short,
        vocab.all_bytes,
        vocab.by_bytes,
        words,
    )
    assert m.accept_token(tokens[0])
    first = vocab.all_bytes[tokens[0]]
    assert all(b"<think></think>\n\n"[len(first) :].startswith(b) for b in spelled(row(m)))
    # A partial closing tag when the budget is spent: the rest follows from it.
    partial = hf_tok.encode("<think>a b </th", add_special_tokens=False)
    assert vocab.all_bytes[partial[-1]].endswith(b"h")
    at_partial = ReasoningSection("<think>", "</think>", "\n\n", max_tokens=len(partial))
    spec = GrammarSpec(GrammarKind.REGEX, "(yes|no)", reasoning=at_partial)
    m = SectionBudget(
        backend.new_matcher(backend.compile(backend.make_compiler(info, 1), spec)),
        at_partial,
        vocab.all_bytes,
        vocab.by_bytes,
        words,
    )
    assert all(m.accept_token(t) for t in partial)
    allowed = spelled(row(m))
    assert allowed and all(b"ink>\n\n".startswith(b) for b in allowed), allowed


def test_budgets_share_one_compiled_grammar_and_bind_per_session(client: Any, bpe_id: str, hf_tok: Any) -> None:
    """Through the live service: every max_tokens value of a section finds the same compiled
    grammar, and each session enforces its own budget on its rows."""
    from specmask.mask_service.client.mask_client import DraftMaskItem

    spec = GrammarSpec(GrammarKind.REGEX, "(yes|no)!", reasoning=QWEN3)
    client.validate_grammar(bpe_id, spec)
    tokens = hf_tok.encode("<think>one two three four five six", add_special_tokens=False)
    accepted = {}
    for budget in (0, len(tokens) - 2, len(tokens) + 20):
        budgeted = GrammarSpec(spec.kind, spec.text, reasoning=dataclasses.replace(QWEN3, max_tokens=budget))
        assert client.validate_grammar(bpe_id, budgeted).cache_hit
        sid = client.open_session(bpe_id, budgeted)
        committed, drafts = list(tokens[:-4]), list(tokens[-4:])
        [res] = client.draft_masks([DraftMaskItem(sid, drafts, commit_tokens=committed, commit_seq=1)])
        accepted[budget] = res.num_grammar_accepted
        client.close_session(sid)
    assert accepted == {0: 4, len(tokens) - 2: 2, len(tokens) + 20: 4}
