"""``format`` fails closed: every asserted format is verifiable, one that is not is refused,
and both engines' format grammars are no looser than the RFC checks the end check runs."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.backends import BACKENDS
from specmask.mask_service.grammar.schema_check import ASSERTED_FORMATS, verifiable_formats
from specmask.mask_service.server.tokenizers import TokenizerRegistry
from specmask.orchestrator.output_check import OutputChecker, OutputCheckError

ENGINES = ("xgrammar", "llguidance")

# (format, value): values on both sides of the RFC line, where the engines' own format
# grammars were looser (days per month, leap years, second 60, IPv4 leading zeros, labels).
SAMPLES: list[tuple[str, str]] = [
    ("date", "2024-02-29"),
    ("date", "2021-02-29"),
    ("date", "1900-02-29"),
    ("date", "2000-02-29"),
    ("date", "2021-04-31"),
    ("date", "2021-12-31"),
    ("date", "2021-13-01"),
    ("date-time", "2021-02-29T23:59:60Z"),
    ("date-time", "2021-02-28T23:59:59Z"),
    ("date-time", "2021-06-30T23:59:60Z"),
    ("date-time", "2021-06-30T12:00:00.25+05:30"),
    ("time", "12:00:60Z"),
    ("time", "23:59:60Z"),
    ("time", "23:59:59Z"),
    ("time", "24:00:00Z"),
    ("ipv4", "127.0.0.1"),
    ("ipv4", "127.0.0.01"),
    ("ipv4", "256.0.0.1"),
    ("hostname", "a" * 63 + ".example.com"),
    ("hostname", "a" * 64 + ".com"),
    ("hostname", "a-.com"),
    ("hostname", "localhost"),
]


def test_every_asserted_format_is_verifiable() -> None:
    """The runtime installs the format checkers (jsonschema[format-nongpl]): none is skipped."""
    assert verifiable_formats() >= ASSERTED_FORMATS, sorted(ASSERTED_FORMATS - verifiable_formats())


def test_unverifiable_format_is_refused(
    registry: TokenizerRegistry, bpe_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime whose jsonschema lacks a checker (a missing optional package) refuses the
    format, naming it, and its end check fails closed."""
    real = jsonschema.Draft202012Validator.FORMAT_CHECKER
    without = jsonschema.FormatChecker([f for f in real.checkers if f != "hostname"])
    monkeypatch.setattr(jsonschema.Draft202012Validator, "FORMAT_CHECKER", without)
    schema = {"type": "object", "properties": {"h": {"type": "string", "format": "hostname", "title": "refused"}}}
    for backend in ENGINES:
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), backend=backend)
        engine = BACKENDS[backend]
        with pytest.raises(GrammarError, match="'hostname'"):
            engine.compile(engine.make_compiler(registry.info(bpe_id, None), 1), spec)
        with pytest.raises(OutputCheckError, match="hostname"):
            OutputChecker().check(spec, '{"h":"example.com"}', engine=backend)
    # A property *named* format is no format keyword.
    named = {"type": "object", "properties": {"format": {"type": "string"}}}
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(named), backend="xgrammar")
    BACKENDS["xgrammar"].compile(BACKENDS["xgrammar"].make_compiler(registry.info(bpe_id, None), 1), spec)


def _grammar_accepts(matcher: Any, hf_tok: Any, text: str, stop: int) -> bool:
    for t in hf_tok.encode(text, add_special_tokens=False):
        if not matcher.accept_token(int(t)):
            return False
    return bool(matcher.accept_token(stop))


@pytest.mark.parametrize("backend", ENGINES)
def test_format_grammars_no_looser_than_the_check(
    registry: TokenizerRegistry, bpe_id: str, hf_tok: Any, backend: str
) -> None:
    engine = BACKENDS[backend]
    info = registry.info(bpe_id, None)
    compiler = engine.make_compiler(info, 1)
    stop = int(info.stop_token_ids[0])
    checker = OutputChecker()
    compiled: dict[str, Any] = {}
    for fmt, value in SAMPLES:
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "string", "format": fmt}), backend=backend)
        if fmt not in compiled:
            compiled[fmt] = engine.compile(compiler, spec)
        text = json.dumps(value)
        valid = checker.check(spec, text, engine=backend).ok
        accepted = _grammar_accepts(engine.new_matcher(compiled[fmt]), hf_tok, text, stop)
        assert accepted == valid, (fmt, value, f"grammar {accepted}, check {valid}")


@pytest.mark.parametrize("backend", ENGINES)
def test_optional_group_with_a_repeat_keeps_its_first_item(
    registry: TokenizerRegistry, bpe_id: str, hf_tok: Any, backend: str
) -> None:
    """xgrammar's JSON-string regex read "(?:ab*)?" as if "a" were optional as well; the
    fractional seconds of date-time ("(?:\\.[0-9]+)?") let digits follow seconds without a dot."""
    engine = BACKENDS[backend]
    info = registry.info(bpe_id, None)
    stop = int(info.stop_token_ids[0])
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "string", "pattern": "^x(?:ab*)?c$"}))
    compiled = engine.compile(engine.make_compiler(info, 1), spec)
    for text, ok in (('"xbc"', False), ('"xabbc"', True), ('"xc"', True)):
        assert _grammar_accepts(engine.new_matcher(compiled), hf_tok, text, stop) is ok, text
