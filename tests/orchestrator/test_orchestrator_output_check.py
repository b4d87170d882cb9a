"""The end-of-request check: independent of the mask path, fails closed."""

from __future__ import annotations

import json

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.orchestrator.output_check import OutputChecker, OutputCheckError, strict_schema

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def spec(kind: GrammarKind, text: object = "", **kw) -> GrammarSpec:
    return GrammarSpec(kind, text if isinstance(text, str) else json.dumps(text), **kw)


@pytest.fixture(scope="module")
def checker() -> OutputChecker:
    return OutputChecker()


@pytest.mark.parametrize(
    ("grammar", "text", "ok"),
    [
        (spec(GrammarKind.JSON_SCHEMA, SCHEMA), '{"a":"x"}', True),
        (spec(GrammarKind.JSON_SCHEMA, SCHEMA), '{"a":1}', False),
        (spec(GrammarKind.JSON_SCHEMA, SCHEMA), '{"a":"x","b":1}', False),  # strict: no extra keys
        (spec(GrammarKind.JSON_SCHEMA, SCHEMA, strict=False), '{"a":"x","b":1}', True),
        (spec(GrammarKind.JSON_SCHEMA, SCHEMA, strict=False), '{"a":"x","a":"y"}', False),  # duplicate key
        (spec(GrammarKind.JSON_SCHEMA, SCHEMA), '{"a":"x"', False),  # truncated
        (spec(GrammarKind.JSON_SCHEMA, SCHEMA), "", False),
        # Finding 1's output: values of extra keys must follow patternProperties.
        (
            spec(
                GrammarKind.JSON_SCHEMA,
                {**SCHEMA, "patternProperties": {".*": {"type": "string"}}},
                strict=False,
            ),
            '{"a":"US407","customer":{"id":9663844}}',
            False,
        ),
        (spec(GrammarKind.JSON_SCHEMA, {"type": "object"}), '{"k":[1,2]}', True),  # no properties listed
        (spec(GrammarKind.JSON_SCHEMA, {"type": "string", "format": "date"}), '"2024-02-30"', False),
        (spec(GrammarKind.ANY_JSON), '{"x":[1,{"y":null}]}', True),
        (spec(GrammarKind.ANY_JSON), "NaN", False),
        (spec(GrammarKind.ANY_JSON), "", False),
        (spec(GrammarKind.REGEX, "[0-9]{5}"), "12345", True),
        (spec(GrammarKind.REGEX, "[0-9]{5}"), "1234", False),  # finding 2's empty/short output
        (spec(GrammarKind.REGEX, "[0-9]{5}"), "", False),
        (spec(GrammarKind.REGEX, "é+"), "éé", True),
        (spec(GrammarKind.EBNF, 'root ::= "a" root | "b"'), "aab", True),
        (spec(GrammarKind.EBNF, 'root ::= "a" root | "b"'), "aa", False),
        (spec(GrammarKind.LARK, 'start: "x"+ "y"'), "xxy", True),
        (spec(GrammarKind.LARK, 'start: "x"+ "y"'), "xyx", False),
    ],
)
def test_verdicts(checker: OutputChecker, grammar: GrammarSpec, text: str, ok: bool) -> None:
    verdict = checker.check(grammar, text)
    assert verdict.ok is ok, verdict
    assert ok or verdict.reason


def test_checker_failure_is_an_error_not_a_pass(checker: OutputChecker) -> None:
    """Fail closed: a grammar the checker cannot build raises; the engine turns that into a violation."""
    with pytest.raises(OutputCheckError):
        checker.check(spec(GrammarKind.EBNF, "root ::= "), "")
    with pytest.raises(OutputCheckError):
        checker.check(spec(GrammarKind.JSON_SCHEMA, "{not json"), "{}")


def test_strict_schema_makes_xgrammar_defaults_explicit() -> None:
    schema = {
        "type": "object",
        "properties": {"t": {"type": "array", "prefixItems": [{"type": "integer"}]}},
        "$defs": {"n": {"properties": {"x": {}}, "additionalProperties": True}},
        "anyOf": [{"patternProperties": {"^a": {}}}, {"type": "object"}],
    }
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["t"]["items"] is False
    assert out["$defs"]["n"]["additionalProperties"] is True  # the caller's own choice is kept
    assert out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["anyOf"][1]  # no properties listed: any keys
    assert "additionalProperties" not in schema  # the original is not modified


def test_compiled_checkers_are_cached(checker: OutputChecker) -> None:
    grammar = spec(GrammarKind.REGEX, "(yes|no)")
    assert checker._checker(grammar) is checker._checker(grammar)
    small = OutputChecker(max_cached=1)
    small.check(grammar, "yes")
    small.check(spec(GrammarKind.REGEX, "x"), "x")
    assert len(small._cache) == 1
    # One validator per reading: no engine named, an unknown one and "xgrammar" share one.
    shared = OutputChecker()
    schema = spec(GrammarKind.JSON_SCHEMA, SCHEMA)
    for engine in ("", "xgrammar", "some-engine"):
        assert shared.check(schema, '{"a":"x","b":1}', engine=engine).ok is False  # xgrammar's strict reading
    assert shared.check(schema, '{"a":"x"}', engine="llguidance").ok
    assert len(shared._cache) == 2


def test_strict_defaults_never_loosen_conditions() -> None:
    """Checked mode reaches the end check with if/not/oneOf: strict defaults pushed into
    a condition must not let a document skip its ``then`` (found by bench.coverage --checked)."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "string"}},
        "if": {"properties": {"c": {"const": "ghi"}}},
        "then": {"required": ["a", "b", "c"]},
        "else": {"required": ["a", "c"]},
    }
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))  # strict (the default)
    checker = OutputChecker()
    assert not checker.check(spec, '{"a":"x","c":"ghi"}').ok  # "then" applies: b is required
    assert checker.check(spec, '{"a":"x","b":1,"c":"ghi"}').ok
    # Plain: {"a":1} matches both branches (invalid); strict alone would close branch 0 and pass it.
    one_of = {"oneOf": [{"type": "object", "properties": {"x": {}}}, {"type": "object", "required": ["a"]}]}
    assert not checker.check(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(one_of)), '{"a":1}').ok


def test_draft7_dependencies_without_a_declared_draft_are_checked() -> None:
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object", "dependencies": {"a": ["b"]}}))
    checker = OutputChecker()
    assert not checker.check(spec, '{"a":1}').ok
    assert checker.check(spec, '{"a":1,"b":2}').ok


@pytest.mark.parametrize(
    ("schema", "text", "ok"),
    [
        # jsonschema's float division: 10000.89 / 0.01 = 1000088.9999999999 (bench.e2e, Github_easy)
        ({"type": "number", "multipleOf": 0.01}, "10000.89", True),
        ({"type": "number", "multipleOf": 0.1}, "0.3", True),
        ({"type": "number", "multipleOf": 0.01}, "10000.891", False),
        ({"type": "number", "multipleOf": 0.1}, "0.35", False),
        ({"type": "number", "multipleOf": 0.5}, "3", True),
        ({"type": "number", "multipleOf": 0.5}, "3.25", False),
        ({"type": "integer", "multipleOf": 3}, "9", True),
        ({"type": "integer", "multipleOf": 3}, "10", False),
        ({"type": "number", "multipleOf": 1e-300}, "1e300", True),  # huge quotient: still decided
        ({"$schema": "http://json-schema.org/draft-04/schema#", "multipleOf": 0.01}, "19.99", True),
        ({"multipleOf": 0.01}, '"not a number"', True),  # multipleOf only constrains numbers
    ],
)
def test_multiple_of_is_decided_in_decimal(checker: OutputChecker, schema: object, text: str, ok: bool) -> None:
    assert checker.check(spec(GrammarKind.JSON_SCHEMA, schema), text).ok is ok


def test_strict_means_what_the_masking_engine_enforced() -> None:
    """llguidance's strict rewrite leaves an intersection open (its additionalProperties: false would
    also forbid the other side's keys); checking its output against xgrammar's reading failed every
    answer of this maskbench schema (Github_trivial---o42156) as a grammar violation."""
    schema = {
        "type": "object",
        "properties": {},
        "oneOf": [
            {"properties": {"status": {"enum": ["ok"]}}, "required": ["status"]},
            {"properties": {"status": {"enum": ["notFound"]}}, "required": ["status"]},
        ],
    }
    grammar = spec(GrammarKind.JSON_SCHEMA, schema)  # strict (the default)
    checker = OutputChecker()
    answer = '{"status":"notFound","properties":{}}'  # what SmolLM2 wrote, through llguidance's masks
    assert checker.check(grammar, answer, "llguidance").ok
    assert not checker.check(grammar, answer, "xgrammar").ok  # xgrammar's reading closes the root
    assert not checker.check(grammar, answer).ok  # no engine named: the stricter reading
    assert not checker.check(grammar, '{"status":"bogus"}', "llguidance").ok  # the schema as written holds
    # Where llguidance does close an object, so does the check.
    closed = spec(GrammarKind.JSON_SCHEMA, {"type": "object", "properties": {"a": {"type": "integer"}}})
    assert not checker.check(closed, '{"a":1,"b":2}', "llguidance").ok
    assert checker.check(spec(GrammarKind.JSON_SCHEMA, schema, strict=False), answer, "xgrammar").ok


def test_validate_decimal_is_jsonschema_validate_with_decimal_multiples() -> None:
    """The bench and demo judges: the schema is checked first, then the instance."""
    import jsonschema

    from specmask.orchestrator.output_check import validate_decimal

    validate_decimal(10000.89, {"type": "number", "multipleOf": 0.01})
    with pytest.raises(jsonschema.ValidationError):
        validate_decimal(10000.891, {"type": "number", "multipleOf": 0.01})
    with pytest.raises(jsonschema.SchemaError):
        validate_decimal(1, {"type": "number", "multipleOf": -1})


def test_strict_reading_keeps_a_required_name_missing_from_properties(checker: OutputChecker) -> None:
    """The mask service declares a required name that ``properties`` lacks before xgrammar's strict
    mode closes the object (schema_rewrite), so the engine emits it; the strict reading must allow
    it too, or every output of such a schema fails (maskbench Github_easy---o27044)."""
    schema = {
        "type": "object",
        "properties": {"colors": {"type": "string", "enum": ["dark", "light"]}},
        "required": ["color"],
    }
    grammar = spec(GrammarKind.JSON_SCHEMA, schema)  # strict (the default)
    for engine in ("xgrammar", "llguidance", ""):
        assert checker.check(grammar, '{"color":"x"}', engine).ok, engine
        assert checker.check(grammar, '{"colors":"dark","color":[1]}', engine).ok, engine
        assert not checker.check(grammar, '{"colors":"dark"}', engine).ok, engine  # required
        assert not checker.check(grammar, '{"colors":"grey","color":1}', engine).ok, engine  # enum
    # xgrammar's reading stays closed to names neither declared nor required.
    assert not checker.check(grammar, '{"color":1,"other":2}', "xgrammar").ok


# ECMA-262 reads these JSON Schema regexes more strictly than Python's ``re`` does; the end
# check must agree with ECMA-262 (specmask/common/ecma_regex.py), never be looser.
@pytest.mark.parametrize(
    ("pattern", "value", "ok"),
    [
        ("^a$", "a", True),
        ("^a$", "a\n", False),  # Python's $ also matches before a final newline
        ("^\\d+$", "123", True),
        ("^\\d+$", "\u0661\u0662", False),  # Arabic-Indic digits: \d is ASCII in ECMA-262
        ("^\\w+$", "caf\u00e9", False),
        ("^\\w+$", "cafe_9", True),
        ("^[\\d\\w-]+$", "a-1", True),
        ("^[\\d]+$", "\u0661", False),
        ("^a.b$", "a\rb", False),  # '.' excludes every ECMA-262 line terminator
        ("^a.b$", "a\u2028b", False),
        ("^a.b$", "a\u00e9b", True),
        ("^\\s$", "\x1c", False),  # Python's \s takes U+001C..U+001F, ECMA-262's does not
        ("^\\s$", "\u00a0", True),
        ("^\\S$", "\x1c", True),
        ("\\bcat\\b", "\u00e9cat", True),  # \b between a non-ASCII letter and 'c' is a boundary
        ("^a\\$$", "a$", True),  # escaped '$' stays a literal
        ("^[$.]+$", "$.", True),  # '$' and '.' in a class stay literals
        ("^[$.]+$", "$x", False),
        ("^[\\w-.]+$", "a-.", True),  # '-' beside a class escape is a literal, not a range
        ("^[\\d-x]+$", "1-x", True),
        ("^[\\d-x]+$", "y", False),
        ("^x[]$", "x", False),  # ECMA-262: [] matches nothing
        ("^x[^]$", "x\n", True),  # ECMA-262: [^] matches anything
    ],
)
def test_patterns_are_read_as_ecma_262(checker: OutputChecker, pattern: str, value: str, ok: bool) -> None:
    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern}}, "required": ["v"]}
    text = json.dumps({"v": value})
    assert checker.check(spec(GrammarKind.JSON_SCHEMA, schema), text).ok is ok
    # patternProperties keys decide which keys a schema sees, and which keys are "additional".
    keyed = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}, "additionalProperties": False}
    assert checker.check(spec(GrammarKind.JSON_SCHEMA, keyed, strict=False), json.dumps({value: 1})).ok is ok


def test_ecma_rewrite_leaves_data_and_property_names_alone() -> None:
    from specmask.common.ecma_regex import ecma_schema

    schema = {
        "properties": {"pattern": {"const": "^a$"}, "b": {"pattern": "a$", "enum": ["$", "."]}},
        "default": {"pattern": "$"},
    }
    assert ecma_schema(schema) == {
        "properties": {"pattern": {"const": "^a$"}, "b": {"pattern": "a\\Z", "enum": ["$", "."]}},
        "default": {"pattern": "$"},
    }


def test_strict_reading_keeps_a_oneof_told_apart_by_not(checker: OutputChecker) -> None:
    """The strict copy drops ``not``; under ``oneOf`` that would make both branches match and
    fail a valid answer (maskbench Github_medium---o65945), so it reads ``oneOf`` as ``anyOf``."""
    a = {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}}
    schema = {"oneOf": [a, {"type": "object", "properties": {"x": {"type": "integer"}}, "not": a}]}
    for engine in ("xgrammar", "llguidance"):
        assert checker.check(spec(GrammarKind.JSON_SCHEMA, schema), '{"x":1}', engine).ok
        assert checker.check(spec(GrammarKind.JSON_SCHEMA, schema), "{}", engine).ok
        assert not checker.check(spec(GrammarKind.JSON_SCHEMA, schema), '{"x":"1"}', engine).ok
