"""Unicode literals in JSON Schemas, per engine: the literal is accepted, a one-character change is not.

    python -m bench.unicode_literals --cases 10000 [--engine xgrammar|llguidance|both] [--seed S]
        [--tokenizer ../shared/data/tokenizers/gpt2]

Each case draws a random string (every plane: C0/C1 controls, quotes and
backslashes, Latin-1, combining marks, RTL scripts, CJK, Hangul, private use,
noncharacters, U+2028/2029, BOM, emoji and other astral characters, and a
character just below U+0100 followed by a hex digit or letter, the spelling
xgrammar's printer made ambiguous: "façade") and places it in one schema
keyword that embeds literal text: ``const``, ``enum``, a property name,
``required`` (without ``properties``), or the literal parts of a ``pattern``.
The schema is compiled for one engine exactly as the mask service does
(``SelectingBackend`` with the engine named), and then:

* the document holding the literal, written as the engine writes it (below), is
  fed token by token (a real tokenizer) to a fresh matcher and must complete
  (stop token accepted), and the end check (``orchestrator.output_check``,
  against the original schema) must pass it;
* three one-code-point changes of the literal (substitute, insert, delete) are
  fed the same way; each the end check refuses must be refused by the grammar
  (else the service would produce it and fail the request, or with a weaker end
  check, lie), and each the end check passes (an enum's other member, a
  pattern's digit run) must be accepted (the grammar is exact, not just safe).
  For ``const``, property names, ``required`` and whole-literal patterns the end
  check must refuse every change (so the test cannot pass vacuously).

A schema an engine refuses counts as a failure unless the refusal is a
documented one: xgrammar does not take property names that JSON must escape
(``"``, ``\\``, controls). Such a case is then compiled as a request naming no
engine gets it (the service routes it to llguidance) and checked the same way
(``xgrammar_refused_served_by_llguidance``). No pattern may require ``"``,
``\\`` or a control character; the generator keeps those out of patterns.

How each engine writes a literal (both are valid JSON; the grammars allow only
this spelling, which the end check accepts as one of many): every character
raw, except ``"``, ``\\`` and U+0000-U+001F, escaped as ``json.dumps`` does, and
U+007F, written ``\\u007f`` by xgrammar except under a ``pattern`` and by
llguidance except in property names.

The last line is ``RESULT {json}`` with the counts per engine; ``failures``
must be 0. ``tests/mask_service/test_mask_unicode_literals.py`` runs a few
hundred cases per engine; ``SPECMASK_UNICODE_CASES`` raises that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.backends import EngineCompilers, SelectingBackend
from specmask.orchestrator.output_check import OutputChecker

ENGINE_NAMES = ("xgrammar", "llguidance")
SEPARATORS = ((",", ":"), (", ", ": "))

# Inclusive code-point ranges drawn from; surrogates are not characters (the service refuses them).
_POOLS: dict[str, tuple[tuple[int, int], ...]] = {
    "ascii": ((0x20, 0x7E),),
    "hex": ((0x30, 0x39), (0x41, 0x46), (0x61, 0x66)),
    "json_escaped": ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)),
    "del_c1_latin1": ((0x7F, 0xFF),),
    "combining": ((0x0300, 0x036F), (0x1AB0, 0x1AFF), (0x20D0, 0x20FF), (0xFE20, 0xFE2F)),
    "scripts": ((0x0370, 0x058F), (0x0590, 0x06FF), (0x0900, 0x097F), (0x0E00, 0x0E7F), (0x1E00, 0x1EFF)),
    "cjk_hangul": ((0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3)),
    "bmp_special": (
        (0x2028, 0x2029),
        (0x200B, 0x200F),
        (0xFEFF, 0xFEFF),
        (0xFFFD, 0xFFFF),
        (0xE000, 0xF8FF),
        (0xFDD0, 0xFDEF),
        (0x0100, 0x0FFF),
    ),
    "emoji": ((0x1F300, 0x1FAFF), (0x1F1E6, 0x1F1FF), (0xFE0F, 0xFE0F), (0x200D, 0x200D)),
    "astral": ((0x10000, 0x1FFFF), (0x20000, 0x2FFFF), (0x30000, 0xDFFFF), (0xE0000, 0xE01EF), (0xF0000, 0x10FFFF)),
}
_POOL_NAMES = tuple(_POOLS)
# Characters a pattern cannot require (the engine could emit them only escaped).
_PATTERN_UNSAFE = frozenset(chr(c) for c in range(0x20)) | {'"', "\\"}
# ECMA-262 and Python syntax characters, escaped in a pattern's literal parts.
_REGEX_SYNTAX = frozenset("\\^$.|?*+()[]{}/-")


class Placement(Enum):
    """Where the literal sits in the schema."""

    CONST = "const"
    ENUM = "enum"
    PROPERTY = "property"
    REQUIRED = "required"
    PATTERN = "pattern"


def _draw_char(rng: random.Random, pool: str) -> str:
    ranges = _POOLS[pool]
    lo, hi = ranges[rng.randrange(len(ranges))]
    return chr(rng.randint(lo, hi))


def random_literal(rng: random.Random, max_len: int = 10) -> str:
    """A random string of 1..max_len code points, often with a character below U+0100 before a hex digit."""
    out: list[str] = []
    for _ in range(rng.randint(1, max_len)):
        if rng.random() < 0.3:  # the ambiguous-escape shape: U+0001..U+00FF (not ASCII text) + hex
            out.append(_draw_char(rng, rng.choice(("json_escaped", "del_c1_latin1", "del_c1_latin1"))))
            out.append(_draw_char(rng, "hex"))
        else:
            out.append(_draw_char(rng, rng.choice(_POOL_NAMES)))
    return "".join(out)


def pattern_literal(rng: random.Random, max_len: int = 8) -> str:
    """A random literal with no character a pattern cannot require."""
    text = "".join(c for c in random_literal(rng, max_len) if c not in _PATTERN_UNSAFE)
    return text or _draw_char(rng, "cjk_hangul")


def regex_escape(text: str) -> str:
    """``text`` as a regex matching exactly it in ECMA-262, Python ``re``, xgrammar and llguidance."""
    return "".join(f"\\{c}" if c in _REGEX_SYNTAX else c for c in text)


@dataclass(frozen=True)
class Case:
    """One schema with a literal, the literal, and how a document holding a given literal is built."""

    placement: Placement
    literal: str
    schema: dict[str, Any]
    separators: tuple[str, str]
    others: tuple[str, ...] = ()  # enum: the other members; pattern: (prefix-free suffix, digits)

    def document(self, literal: str) -> Any:
        if self.placement in (Placement.CONST, Placement.ENUM):
            return literal
        if self.placement in (Placement.PROPERTY, Placement.REQUIRED):
            return {literal: 7}
        suffix, digits = self.others if self.others else ("", "")
        return literal + digits + suffix

    @property
    def whole_literal(self) -> bool:
        """Whether every change of the literal must be refused (not an enum, not a pattern with a digit run)."""
        return self.placement in (Placement.CONST, Placement.PROPERTY, Placement.REQUIRED) or (
            self.placement is Placement.PATTERN and not self.others
        )


def make_case(rng: random.Random) -> Case:
    placement = rng.choice(list(Placement))
    sep = rng.choice(SEPARATORS)
    if placement is Placement.PATTERN:
        lit = pattern_literal(rng)
        if rng.random() < 0.5:
            return Case(placement, lit, {"type": "string", "pattern": f"^{regex_escape(lit)}$"}, sep)
        suffix = pattern_literal(rng, 4)
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
        pattern = f"^{regex_escape(lit)}[0-9]{{1,3}}{regex_escape(suffix)}$"
        return Case(placement, lit, {"type": "string", "pattern": pattern}, sep, (suffix, digits))
    lit = random_literal(rng)
    if placement is Placement.CONST:
        return Case(placement, lit, {"const": lit}, sep)
    if placement is Placement.ENUM:
        others = tuple(o for o in dict.fromkeys(random_literal(rng, 4) for _ in range(rng.randint(0, 3))) if o != lit)
        members: list[Any] = [lit, *others]
        rng.shuffle(members)
        if rng.random() < 0.3:
            members.append(rng.choice([1, None, True]))
        return Case(placement, lit, {"enum": members}, sep, others)
    if placement is Placement.PROPERTY:
        schema = {"type": "object", "properties": {lit: {"type": "integer"}}, "required": [lit]}
        return Case(placement, lit, schema, sep)
    return Case(placement, lit, {"type": "object", "required": [lit]}, sep)


def mutations(rng: random.Random, literal: str, in_pattern: bool) -> list[tuple[str, str]]:
    """(kind, changed literal): one code point substituted, inserted, and deleted.

    ``in_pattern``: new characters are ones a pattern could hold (a string under a
    pattern never holds an escape, and Python's ``$`` also matches before a final
    line feed, which ECMA-262's does not: the end check reads patterns with ``re``)."""

    def draw() -> str:
        while True:
            c = _draw_char(rng, rng.choice(_POOL_NAMES))
            if not (in_pattern and c in _PATTERN_UNSAFE):
                return c

    cps = list(literal)
    out = []
    i = rng.randrange(len(cps))
    new = draw()
    while new == cps[i]:
        new = draw()
    out.append(("substitute", "".join(cps[:i] + [new] + cps[i + 1 :])))
    j = rng.randint(0, len(cps))
    out.append(("insert", "".join(cps[:j] + [draw()] + cps[j:])))
    k = rng.randrange(len(cps))
    out.append(("delete", "".join(cps[:k] + cps[k + 1 :])))
    return out


def spelling(doc: Any, case: Case, engine: str) -> str:
    """The document as the engine's grammar writes it (see the module doc: U+007F)."""
    text = json.dumps(doc, ensure_ascii=False, separators=case.separators)
    is_key = case.placement in (Placement.PROPERTY, Placement.REQUIRED)
    escapes_del = not is_key if engine == "llguidance" else case.placement is not Placement.PATTERN
    return text.replace("\x7f", "\\u007f") if escapes_del else text


def documented_refusal(engine: str, case: Case, message: str) -> bool:
    """A refusal the docs list (docs/grammars.md), not a failure of this test."""
    needs_escape = any(c in '"\\' or ord(c) < 0x20 for c in case.literal)
    if engine == "xgrammar" and case.placement in (Placement.PROPERTY, Placement.REQUIRED) and needs_escape:
        return "escaped property name" in message
    return False


@dataclass
class Tally:
    cases: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {**dict(self.cases), "failures": len(self.failures)}


class Runner:
    """Compiles cases for one engine the way the mask service does and checks them token by token."""

    def __init__(self, tokenizer_dir: Path) -> None:
        from specmask.mask_service.server.tokenizers import TokenizerSource, load_tokenizer

        loaded = load_tokenizer(TokenizerSource(str(tokenizer_dir)))
        self.hf = loaded.hf_tokenizer
        self.info = loaded.infos[loaded.default_vocab_size]
        self.stop = int(self.info.stop_token_ids[0])
        self.compilers = EngineCompilers(self.info, 1)
        self.backend = SelectingBackend()
        self.checker = OutputChecker(max_cached=8)

    def grammar_accepts(self, matcher: Any, text: str) -> bool:
        for token in self.hf.encode(text, add_special_tokens=False):
            if not matcher.accept_token(int(token)):
                return False
        return bool(matcher.accept_token(self.stop))

    def run(self, case: Case, changes: list[tuple[str, str]], engine: str, tally: Tally) -> None:
        """One case on ``engine``; a documented refusal is then served by the service's own selection."""
        spec = GrammarSpec(
            GrammarKind.JSON_SCHEMA, json.dumps(case.schema, ensure_ascii=False), separators=case.separators
        )
        tally.cases[f"{engine}_cases"] += 1
        try:
            compiled = self.backend.compile(self.compilers, dataclasses.replace(spec, backend=engine))
        except GrammarError as exc:
            if not documented_refusal(engine, case, exc.message):
                tally.failures.append(f"{engine}/{case.placement.value}: refused {case.schema!r}: {exc.message}")
                return
            tally.cases[f"{engine}_refused_documented"] += 1
            try:  # what a request naming no engine gets
                compiled = self.backend.compile(self.compilers, spec)
            except GrammarError as again:
                tally.failures.append(f"auto/{case.placement.value}: refused {case.schema!r}: {again.message}")
                return
            if self._check(case, changes, spec, compiled, tally):
                tally.cases[f"{engine}_refused_served_by_{compiled.backend}"] += 1
            return
        if self._check(case, changes, spec, compiled, tally):
            tally.cases[f"{engine}_passed"] += 1

    def _check(
        self, case: Case, changes: list[tuple[str, str]], spec: GrammarSpec, compiled: Any, tally: Tally
    ) -> bool:
        engine = compiled.backend  # the engine that compiled it (a SelectedGrammar)
        key = f"{engine}/{case.placement.value}"

        def check(literal: str) -> tuple[bool, bool, str]:
            text = spelling(case.document(literal), case, engine)
            grammar = self.grammar_accepts(self.backend.new_matcher(compiled), text)
            return grammar, self.checker.check(spec, text, engine).ok, text

        grammar, end, text = check(case.literal)
        if not (grammar and end):
            tally.failures.append(f"{key}: literal {text!r} grammar={grammar} end_check={end} schema={case.schema!r}")
            return False
        failed = len(tally.failures)
        for kind, changed in changes:
            grammar, end, text = check(changed)
            tally.cases[f"{engine}_changes"] += 1
            if end and case.whole_literal:
                tally.failures.append(f"{key}: {kind} {text!r} passes the end check of {case.schema!r}")
            elif grammar != end:
                tally.failures.append(
                    f"{key}: {kind} {text!r} grammar={grammar} end_check={end} schema={case.schema!r}"
                )
        return len(tally.failures) == failed


def run_cases(runner: Runner, engines: tuple[str, ...], cases: int, seed: int) -> Tally:
    """``cases`` seeded cases per engine (the same cases and changes for each engine)."""
    tally = Tally()
    for engine in engines:
        rng = random.Random(seed)
        for _ in range(cases):
            case = make_case(rng)
            runner.run(case, mutations(rng, case.literal, case.placement is Placement.PATTERN), engine, tally)
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1000, help="cases per engine")
    parser.add_argument("--engine", choices=(*ENGINE_NAMES, "both"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    default_tok = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tokenizers" / "gpt2"
    parser.add_argument("--tokenizer", type=Path, default=default_tok)
    args = parser.parse_args(argv)
    engines = ENGINE_NAMES if args.engine == "both" else (args.engine,)
    runner = Runner(args.tokenizer)
    start = time.perf_counter()
    tally = run_cases(runner, engines, args.cases, args.seed)
    for failure in tally.failures:
        print("FAIL", failure)
    result = {**tally.summary(), "seed": args.seed, "seconds": round(time.perf_counter() - start, 1)}
    print("RESULT " + json.dumps(result, ensure_ascii=False))
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
