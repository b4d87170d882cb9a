"""Non-ASCII literals in JSON Schemas compile exactly, on both engines.

xgrammar 0.2.8 prints U+0080-U+00FF (and some controls) as ``\\xHH`` but reads
``\\x`` with every hex digit after it, so the service's re-parse of a printed
grammar turned ``const: "façade"`` into U+E7ADE and no request for it could ever
complete (``ebnf_escapes``). The property test (``bench.unicode_literals``) puts
random Unicode strings into ``const``, ``enum``, property names, ``required`` and
pattern literals and checks, per engine and token by token with a real
tokenizer, that the literal is accepted, that one-code-point changes are refused,
and that the end check agrees. ``SPECMASK_UNICODE_CASES`` sets the number of
cases per engine (the suite runs a few hundred; ``python -m bench.unicode_literals
--cases 10000`` is the long run).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.unicode_literals import ENGINE_NAMES, Case, Placement, Runner, Tally, make_case, mutations, run_cases
from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import MaskServiceClient, MaskServiceError
from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.ebnf_escapes import reparse_exactly, unambiguous_escapes
from specmask.mask_service.grammar.json_regex import json_safe_pattern
from tests.fixtures.shared_data import require
from tests.mask_service.service_config import open_session_retrying

CASES = int(os.environ.get("SPECMASK_UNICODE_CASES", "200"))
ISSUE_WORDS = ("naïve façade ☃", "Décembre", "Ñandú", "çade", "é0", "ÿF", "\x7fb", "\x80\x81a", "😀0")


@pytest.fixture(scope="module")
def runner(shared_data: Path) -> Runner:
    return Runner(require(shared_data, "tokenizers", "gpt2"))


def test_printed_escapes_read_back_as_printed() -> None:
    """Every code point xgrammar prints as ``\\xHH``, followed by a hex digit, in a literal and in both
    kinds of class: the rewritten text parses to the grammar that was printed."""
    import xgrammar as xgr

    changed = 0
    for cp in range(0x01, 0x100):
        for follower in "0aF9g":
            f = ord(follower)
            for form in (f'"\\U{cp:08x}\\U{f:08x}"', f"[\\U{cp:08x}\\U{f:08x}]", f"[^\\U{cp:08x}\\U{f:08x}]"):
                printed = str(xgr.Grammar.from_ebnf(f"root ::= {form}"))
                text = reparse_exactly(printed)
                changed += text != printed
                assert str(xgr.Grammar.from_ebnf(text)) == printed, (hex(cp), follower, printed, text)
    assert changed > 1000  # the printer's \xHH forms were met and rewritten


def test_escaped_backslash_is_not_an_escape() -> None:
    # ``\\xe7`` in a literal is a backslash and the text "xe7"; ``\\\xe7`` is a backslash and ç.
    assert unambiguous_escapes('root ::= "\\\\xe7" [\\\\x]') == 'root ::= "\\\\xe7" [\\\\x]'
    assert unambiguous_escapes('root ::= "\\\\\\xe7a"') == 'root ::= "\\\\\\u00e7a"'
    assert unambiguous_escapes('root ::= rule_x1 [\\xe7a] "\\x7fb"') == 'root ::= rule_x1 [\\u00e7a] "\\u007fb"'


def test_unfaithful_print_refused() -> None:
    """A grammar whose text form reads back as another grammar is refused, not changed: xgrammar's
    printer cuts a string literal at U+0000, here down to nothing."""
    import xgrammar as xgr

    printed = str(xgr.Grammar.from_ebnf('root ::= "\\U00000000" [^x]'))
    with pytest.raises(GrammarError, match="does not read back"):
        reparse_exactly(printed)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("word", ISSUE_WORDS)
def test_issue_words(runner: Runner, engine: str, word: str) -> None:
    """The reported literals, in every placement: accepted, and the misread code point refused."""
    sep = (",", ":")
    for case in (
        Case(Placement.CONST, word, {"const": word}, sep),
        Case(Placement.ENUM, word, {"enum": [word, "x"]}, sep, ("x",)),
        Case(Placement.PROPERTY, word, {"type": "object", "properties": {word: {"type": "integer"}}}, sep),
        Case(Placement.REQUIRED, word, {"type": "object", "required": [word]}, sep),
    ):
        tally = Tally()
        runner.run(case, mutations(random.Random(0), word, False), engine, tally)
        assert tally.failures == [] and tally.cases[f"{engine}_passed"] == 1, tally.failures
    misread = "\U000e7ade"  # what "\xe7ade" read greedily names
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"const": "çade"}), backend=engine)
    compiled = runner.backend.compile(runner.compilers, spec)
    assert runner.grammar_accepts(runner.backend.new_matcher(compiled), '"çade"')
    assert not runner.grammar_accepts(runner.backend.new_matcher(compiled), json.dumps(misread, ensure_ascii=False))


@pytest.mark.parametrize("kind,text,good,bad", [
    (GrammarKind.EBNF, 'root ::= "façade" [^x]', "façade!", "fa\U000e7ade!"),
    (GrammarKind.EBNF, 'root ::= [àa-f]+ "\\u007fb" [^x]', "àb\x7fbz", "à\u07fbz"),
    (GrammarKind.REGEX, "[^x]Décembre", "!Décembre", "!D\ue9cembre"),
    (GrammarKind.LARK, 'start: "Ñandú" /[^x]/', "Ñandú!", "\u0d1andú!"),
])  # fmt: skip
def test_text_grammars(runner: Runner, kind: GrammarKind, text: str, good: str, bad: str) -> None:
    """Regex, EBNF and Lark grammars are re-parsed too (surrogate-free classes): same literals, same fix."""
    compiled = runner.backend.compile(runner.compilers, GrammarSpec(kind, text, backend="xgrammar"))
    assert runner.grammar_accepts(runner.backend.new_matcher(compiled), good)
    assert not runner.grammar_accepts(runner.backend.new_matcher(compiled), bad)


def test_pattern_escapes_are_fixed_width() -> None:
    """json_safe_pattern never writes ``\\xHH``: xgrammar's regex reader takes ``\\x20a`` as U+020A."""
    import xgrammar as xgr

    for pattern, text in (("^ a$", " a"), ("^\x7fb$", "\x7fb"), ("^[ -~]ç0$", "bç0"), ("^\U0001f6000$", "😀0")):
        safe = json_safe_pattern(pattern, "#")
        assert "\\x" not in safe, safe
        assert xgr.testing._is_grammar_accept_string(xgr.Grammar.from_regex(safe), text), (pattern, safe)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_random_unicode_literals(runner: Runner, engine: str) -> None:
    tally = run_cases(runner, (engine,), CASES, seed=1)
    summary = json.dumps(tally.summary())
    assert tally.failures == [], "\n".join(tally.failures[:20]) + "\n" + summary
    assert tally.cases[f"{engine}_passed"] >= CASES * 3 // 4, summary  # refusals stay the exception
    # Every case is served: by the engine, or (a documented refusal) by the service's selection.
    served = tally.cases[f"{engine}_passed"] + tally.cases[f"{engine}_refused_served_by_llguidance"]
    assert served == CASES, summary
    assert tally.cases[f"{engine}_changes"] >= tally.cases[f"{engine}_passed"] * 3, summary


def test_generator_covers_every_placement_and_plane() -> None:
    rng = random.Random(1)
    cases = [make_case(rng) for _ in range(CASES)]
    assert {c.placement for c in cases} == set(Placement)
    chars = {ord(ch) for c in cases for ch in c.literal}
    assert any(cp > 0xFFFF for cp in chars) and any(0x300 <= cp <= 0x36F for cp in chars)
    assert any(
        0x80 <= ord(a) <= 0xFF and b in "0123456789abcdefABCDEF"
        for c in cases
        for a, b in zip(c.literal, c.literal[1:])
    )


def _accepts(client: MaskServiceClient, tid: str, hf_tok: Any, spec: GrammarSpec, text: str) -> bool:
    info = client.open_session_info(tid, spec)
    tokens = hf_tok.encode(text, add_special_tokens=False) + [int(info.stop_token_ids[0])]
    try:
        return client.commit(info.session_id, 1, tokens)
    except MaskServiceError as exc:
        assert exc.code == grpc.StatusCode.FAILED_PRECONDITION, exc
        return False
    finally:
        client.close_session(info.session_id)


def test_service_serves_the_reported_schema(client: MaskServiceClient, bpe_id: str, hf_tok: Any) -> None:
    """Over gRPC, through the compile worker: the schema from the report completes with its literal."""
    schema = {"type": "object", "properties": {"w": {"const": "naïve façade ☃"}}, "required": ["w"]}
    for backend in ("", "xgrammar", "llguidance"):
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), backend=backend)
        client.close_session(open_session_retrying(client, bpe_id, spec, budget_s=120))
        assert _accepts(client, bpe_id, hf_tok, spec, '{"w":"naïve façade ☃"}'), backend
        assert not _accepts(client, bpe_id, hf_tok, spec, '{"w":"naïve fa\U000e7ade ☃"}'), backend
