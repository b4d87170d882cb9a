"""format_patterns: each format's regex against the end check's checker, and the engines on it.

Property tests: seeded random strings drawn from each regex must pass the checker
(``jsonschema`` with ``format-nongpl``, what the end check runs); one-character
mutations of them that the checker rejects must be refused by the regex; for the
formats whose regex equals the checker's language, mutations the checker accepts
must match too. Then the real engines: a corpus of near-misses per format is
refused (and valid strings accepted) by both xgrammar and llguidance, including
formats folded with lengths and intersected with a caller's pattern. Last, the
JSON-Schema-Test-Suite's format cases: the regex accepts no string the suite or
the checker calls invalid.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from re import _constants as sre_constants  # type: ignore[attr-defined]  # regex parser: draws strings
from re import _parser as sre_parse
from typing import Any

import jsonschema
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.grammar.backends import BACKENDS
from specmask.mask_service.grammar.format_patterns import FORMAT_REGEXES, LENGTH_BOUNDED, _label, pattern_for
from specmask.mask_service.server.tokenizers import TokenizerRegistry
from specmask.orchestrator.output_check import OutputChecker
from tests.fixtures.shared_data import require, shared_data_dir

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
# Formats whose regex is the checker's whole language (but a trailing line feed, which Python's
# `$` lets the date-time checker pass). The others are stricter, following the standard.
EXACT = ("date", "date-time", "time", "ipv4", "ipv6")
# Characters the mutations draw from: the formats' own alphabet plus a few outsiders.
MUTATIONS = "0123456789abcdefABCDEFTZtz:-.+_@PYMDWHS x/%[]\u00e9\u0662"


def _sample(items: Any, rnd: random.Random, out: list[str]) -> None:
    """Append a random string of a parsed regex (the subset format_patterns uses)."""
    for op, av in items:
        if op is sre_constants.LITERAL:
            out.append(chr(av))
        elif op is sre_constants.IN:
            lo, hi = rnd.choice([(a, a) if o is sre_constants.LITERAL else a for o, a in av])
            out.append(chr(rnd.randint(lo, hi)))
        elif op is sre_constants.BRANCH:
            _sample(rnd.choice(av[1]), rnd, out)
        elif op is sre_constants.SUBPATTERN:
            _sample(av[-1], rnd, out)
        elif op is sre_constants.MAX_REPEAT:
            lo, hi, sub = av
            for _ in range(rnd.randint(lo, min(hi, lo + 8))):
                _sample(sub, rnd, out)
        elif op is not sre_constants.AT:
            raise AssertionError(f"regex construct {op} not sampled")


def sample(regex: str, rnd: random.Random) -> str:
    out: list[str] = []
    _sample(sre_parse.parse(regex), rnd, out)
    return "".join(out)


def conforms(value: str, fmt: str) -> bool:
    try:
        return bool(CHECKER.conforms(value, fmt))
    except Exception:  # the duration checker overflows on some exponents: the end check fails closed
        return False


def mutate(value: str, rnd: random.Random) -> str:
    chars = list(value)
    pos = rnd.randrange(len(chars) + 1)
    kind = rnd.randrange(3)
    if kind == 0 or not chars:
        chars.insert(pos, rnd.choice(MUTATIONS))
    elif kind == 1:
        chars[min(pos, len(chars) - 1)] = rnd.choice(MUTATIONS)
    else:
        del chars[min(pos, len(chars) - 1)]
    return "".join(chars)


@pytest.mark.parametrize("fmt", sorted(FORMAT_REGEXES))
def test_regex_strings_pass_the_checker(fmt: str) -> None:
    rnd = random.Random(fmt)
    regex = re.compile(pattern_for(fmt) or "")
    for _ in range(400):
        value = sample(regex.pattern, rnd)
        assert regex.fullmatch(value), (fmt, value)
        assert conforms(value, fmt), (fmt, value)


@pytest.mark.parametrize("fmt", sorted(FORMAT_REGEXES))
def test_near_misses_follow_the_checker(fmt: str) -> None:
    rnd = random.Random(f"{fmt}-near")
    regex = re.compile(pattern_for(fmt) or "")
    refused = 0
    for _ in range(3000):
        value = mutate(sample(regex.pattern, rnd), rnd)
        matched, valid = regex.fullmatch(value) is not None, conforms(value, fmt)
        assert valid or not matched, f"{fmt}: the regex accepts {value!r}, which the checker rejects"
        if fmt in EXACT:
            assert matched or not valid or value.endswith("\n"), f"{fmt}: the regex refuses valid {value!r}"
        refused += not matched
    assert refused > 300  # the mutations do reach the other side of the regex


def test_length_bounded_hostname() -> None:
    """The exact hostname form: any number of labels beside maxLength 253."""
    rnd = random.Random("hostname-labels")
    regex, longest = LENGTH_BOUNDED["hostname"]
    labels = re.compile(f"^{regex}$")
    refused = 0
    for _ in range(2000):
        value = sample(f"^(?:{_label(63)}\\.){{0,6}}{_label(63)}$", rnd)
        assert labels.fullmatch(value)
        assert conforms(value, "hostname") is (len(value) <= longest), value
        near = mutate(value, rnd)
        ok = labels.fullmatch(near) is not None and len(near) <= longest
        assert conforms(near, "hostname") or not ok, near
        refused += not ok
    assert refused > 200


@pytest.mark.parametrize("fmt", ["date-time", "time", "date", "uuid", "ipv4"])
def test_length_windows_are_exact(fmt: str) -> None:
    """pattern_for with lengths: exactly the format's strings of those lengths, or None."""
    rnd = random.Random(f"{fmt}-len")
    unbounded = re.compile(pattern_for(fmt) or "")
    values = [sample(unbounded.pattern, rnd) for _ in range(600)]
    for lo, hi in [(0, 20), (0, 21), (20, 25), (21, 30), (26, 26), (9, 9), (8, 14), (30, math.inf), (0, 36), (10, 10)]:
        windowed = pattern_for(fmt, lo, hi)
        if windowed is None:
            # Only where the window cuts a fixed-range format (not expressible), never for timed ones
            # unless no string fits.
            assert fmt not in ("date-time", "time") or not any(lo <= len(v) <= hi for v in values)
            continue
        regex = re.compile(windowed)
        for v in values:
            assert (regex.fullmatch(v) is not None) == (lo <= len(v) <= hi), (fmt, lo, hi, v)
        for _ in range(50):
            v = sample(windowed, rnd)
            assert unbounded.fullmatch(v) and lo <= len(v) <= hi, (fmt, lo, hi, v)


# Near-misses per format (each rejected by the checker) and valid neighbours.
NEAR_MISSES: dict[str, list[str]] = {
    "date": ["2021-02-29", "1900-02-29", "2021-04-31", "2021-13-01", "0000-01-01", "2021-1-01", "2021-01-01\n"],
    "date-time": [
        "2021-02-29T00:00:00Z",
        "2021-06-30T23:59:60Z",
        "2021-06-30T24:00:00Z",
        "2021-06-30T12:00:00",
        "2021-06-30T12:00:00.Z",
        "2021-06-30 12:00:00Z",
        "2021-06-30T12:00:00+24:00",
        "2021-06-30T12:00:0012Z",
    ],
    "time": ["23:59:60Z", "24:00:00Z", "12:00:00", "12:00:00+01", "12:60:00Z", "1:00:00Z"],
    "duration": ["P", "PT", "P1DT", "P1W1D", "P1d", "P1"],
    "uuid": [
        "2eb8aa08-aa98-11ea-b4aa-73b441d1638",
        "2eb8aa08aa9811eab4aa73b441d16380",
        "2eb8aa08-aa98-11ea-b4aa-73b441d1638g",
    ],
    "ipv4": ["127.0.0.01", "256.0.0.1", "1.2.3", "1.2.3.4.5", "1.2.3.-4"],
    "ipv6": [":::", "1::2::3", "1:2:3:4:5:6:7:8:9", "12345::", "::1.2.3.04", "fe80::1%eth0"],
    "hostname": ["-a.com", "a-.com", "a" * 64 + ".com", "a..b", "a_b.com", ""],
    "email": ["a", "example.com"],
}
# The standard refuses them, the checker passes them (more lenient: format_patterns' docstring):
# the grammar follows the standard.
STRICTER: dict[str, list[str]] = {
    "duration": ["PT1.5S", "P1Y2D", "-P1D", "PT1H2S"],
    "uuid": ["2eb8aa08-aa98-11ea-b4aa-73b441d1_380"],
    "hostname": ["example.", "xn--X"],
    "email": ["@example.com", "a@", "a@@b.com", '"quoted"@example.com'],
}
VALID: dict[str, list[str]] = {
    "date": ["2024-02-29", "2000-02-29", "2021-12-31"],
    "date-time": ["2021-06-30T12:00:00.25+05:30", "2020-02-29t23:59:59z"],
    "time": ["23:59:59Z", "00:00:00.123456-23:59"],
    "duration": ["P1Y2M3DT4H5M6S", "PT1M", "P2W", "P0D"],
    "uuid": ["2EB8AA08-aa98-11ea-b4aa-73b441d16380"],
    "ipv4": ["0.0.0.0", "255.255.255.255"],
    "ipv6": ["::", "::1", "1:2:3:4:5:6:7::", "::ffff:192.168.0.1", "fe80::1"],
    "hostname": ["localhost", "a" * 63 + ".example.com", "1.2.3.4", "a-b.c"],
    "email": ["a@b", "first.last+tag@example.co.uk"],
}


def _accepts(matcher: Any, hf_tok: Any, text: str, stop: int) -> bool:
    for t in hf_tok.encode(text, add_special_tokens=False):
        if not matcher.accept_token(int(t)):
            return False
    return bool(matcher.accept_token(stop))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_engines_refuse_near_misses(registry: TokenizerRegistry, bpe_id: str, hf_tok: Any, backend: str) -> None:
    engine = BACKENDS[backend]
    info = registry.info(bpe_id, None)
    compiler = engine.make_compiler(info, 1)
    stop = int(info.stop_token_ids[0])
    checker = OutputChecker()
    for fmt in sorted(FORMAT_REGEXES):
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "string", "format": fmt}), backend=backend)
        compiled = engine.compile(compiler, spec)
        for value in NEAR_MISSES[fmt] + VALID[fmt]:
            text = json.dumps(value)
            valid = checker.check(spec, text, engine=backend).ok
            assert valid is (value in VALID[fmt]), (fmt, value)  # the corpus is what it claims
            assert _accepts(engine.new_matcher(compiled), hf_tok, text, stop) is valid, (backend, fmt, value)
        for value in STRICTER.get(fmt, []):
            text = json.dumps(value)
            assert checker.check(spec, text, engine=backend).ok, (fmt, value)
            assert not _accepts(engine.new_matcher(compiled), hf_tok, text, stop), (backend, fmt, value)


@pytest.mark.parametrize(
    ("schema", "backend", "cases"),
    [
        # Folded: the lengths become fraction digits, and xgrammar serves it.
        (
            {"type": "string", "format": "date-time", "maxLength": 24},
            "xgrammar",
            {"2021-06-30T12:00:00Z": True, "2021-06-30T12:00:00.123Z": True, "2021-06-30T12:00:00.1234Z": False},
        ),
        (
            {"type": "string", "format": "uuid", "maxLength": 36},
            "xgrammar",
            {"2eb8aa08-aa98-11ea-b4aa-73b441d16380": True},
        ),
        # A caller's pattern beside the format: llguidance intersects the two regexes.
        (
            {"type": "string", "format": "date", "pattern": "^2020-"},
            "llguidance",
            {"2020-02-29": True, "2020-02-30": False, "2021-01-01": False},
        ),
        # Hostname: any number of labels within 253 characters, on llguidance.
        (
            {"type": "string", "format": "hostname"},
            "llguidance",
            {".".join(["a" * 40] * 6): True, ".".join(["a" * 50] * 5): False, "a" * 64: False},
        ),
        # Lengths that cut a variable-length format: llguidance intersects pattern and lengths.
        ({"type": "string", "format": "email", "maxLength": 6}, "llguidance", {"a@b.co": True, "ab@c.de": False}),
    ],
)
def test_format_beside_other_string_keywords(
    registry: TokenizerRegistry, bpe_id: str, hf_tok: Any, schema: dict[str, Any], backend: str, cases: dict[str, bool]
) -> None:
    """Served by the engine named (``auto`` picks it), enforcing every keyword."""
    auto = BACKENDS["auto"]
    info = registry.info(bpe_id, None)
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    selected = auto.compile(auto.make_compiler(info, 1), spec)
    assert selected.backend == backend
    stop = int(info.stop_token_ids[0])
    for value, ok in cases.items():
        assert OutputChecker().check(spec, json.dumps(value), engine=backend).ok is ok, value
        assert _accepts(auto.new_matcher(selected), hf_tok, json.dumps(value), stop) is ok, value


@pytest.mark.parametrize("fmt", sorted(FORMAT_REGEXES))
def test_suite_cases(fmt: str) -> None:
    """JSON-Schema-Test-Suite's optional format cases: the regex accepts nothing the suite or the
    checker calls invalid; what it refuses that both call valid is a known, documented gap."""
    base = shared_data_dir()
    if base is None:
        pytest.skip("shared data not found")
    path: Path = require(base, "json-schema-test-suite", "draft2020-12", "optional", "format", f"{fmt}.json")
    regex = re.compile(pattern_for(fmt) or "")
    refused_valid = []
    for group in json.loads(path.read_text()):
        for test in group["tests"]:
            value = test["data"]
            if not isinstance(value, str):
                continue
            if regex.fullmatch(value):
                assert test["valid"] and conforms(value, fmt), (fmt, value)
            elif test["valid"] and conforms(value, fmt):
                refused_valid.append(value)
    # Quoted local parts and address literals: valid RFC 5321 mailboxes outside the dot-atom subset.
    known = {"email": {'"joe bloggs"@example.com', '"joe..bloggs"@example.com', '"joe@bloggs"@example.com'}}
    unexplained = [
        v
        for v in refused_valid
        if v not in known.get(fmt, set())
        and not v.startswith("joe.bloggs@[")
        # A-labels (punycode) are valid hostnames a regex cannot check: refused with every "--" label.
        and not (fmt == "hostname" and any(label[2:4] == "--" for label in v.split(".")))
    ]
    assert not unexplained, unexplained
