"""exact_rewrites (allOf merged, dependencies expanded, anyOf distributed, enums filtered or
enumerated): the same language.

Three kinds of evidence:

* unit cases per rule, with the rewritten schema and instances on both sides of each
  constraint judged by ``jsonschema`` before and after;
* the JSON-Schema-Test-Suite's allOf / anyOf / oneOf / dependentRequired / dependentSchemas
  (2020-12) and allOf / dependencies (draft 7) groups, and every maskbench schema a rule
  changes: each labelled instance gets the same ``jsonschema`` verdict from the original and
  the rewrite; in strict mode, whatever the rewrite accepts under the masking engine's strict
  reading passes the end check against the original (never a lie);
* the engines: those test-suite groups compiled through the service's selection on each
  engine, every instance fed token by token: a grammar accepts exactly the instances
  ``jsonschema`` says are valid.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from bench.coverage import serializations
from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.errors import MaskError
from specmask.mask_service.grammar.backends import BACKENDS
from specmask.mask_service.grammar.exact_rewrites import RULES, rewrite_exact
from specmask.mask_service.grammar.llguidance_check import strict_schema as llguidance_strict
from specmask.mask_service.server.tokenizers import TokenizerRegistry
from specmask.orchestrator.output_check import OutputChecker, strict_schema, without_assertions
from tests.fixtures.shared_data import require, shared_data_dir

DRAFT7 = "http://json-schema.org/draft-07/schema#"
# (file, draft directory) of the test-suite groups the rules are checked on.
SUITE_FILES = [
    ("allOf", "draft2020-12"),
    ("anyOf", "draft2020-12"),
    ("oneOf", "draft2020-12"),
    ("dependentRequired", "draft2020-12"),
    ("dependentSchemas", "draft2020-12"),
    ("allOf", "draft7"),
    ("dependencies", "draft7"),
]
PROBES: list[Any] = [None, True, 0, 1, 2.5, -3, 12, "", "a", "abcd", [], [1], {}]
PROBES += [{"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {"a": "x", "b": "y"}, {"a": 1, "c": 3}, {"c": 1}]
PROBES += [{"a": 1, "b": 2, "c": 3}, {"a": 20}, {"a": "long string"}, {"kind": "x", "a": 1}, {"kind": "y", "b": 1}]


class _Judge:
    """``jsonschema``'s verdict as the end check reads a schema: its declared draft, and where
    none is declared and draft 4-7's ``dependencies`` is used, that draft's reading too."""

    def __init__(self, schema: Any) -> None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        self.validators = [cls(schema, format_checker=cls.FORMAT_CHECKER)]
        if isinstance(schema, dict) and "$schema" not in schema and '"dependencies"' in json.dumps(schema):
            draft7 = jsonschema.Draft7Validator
            self.validators.append(draft7(schema, format_checker=draft7.FORMAT_CHECKER))

    def is_valid(self, instance: Any) -> bool:
        return all(v.is_valid(instance) for v in self.validators)


def _validator(schema: Any) -> _Judge:
    return _Judge(schema)


def _same_verdicts(original: Any, rewritten: Any, instances: list[Any], where: str) -> None:
    before, after = _validator(original), _validator(rewritten)
    for instance in instances:
        assert before.is_valid(instance) == after.is_valid(instance), (where, instance, rewritten)


UNIT: list[tuple[str, dict[str, Any], str, bool]] = [
    # (name, schema, the rule expected to change it, strict)
    (
        "allOf of objects",
        {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
        "allOf",
        False,
    ),
    (
        "allOf of bounds",
        {"allOf": [{"type": "number", "minimum": 0}, {"maximum": 10}, {"type": "integer"}]},
        "allOf",
        False,
    ),
    (
        "allOf with a closed side",
        {
            "allOf": [
                {"properties": {"a": {}}, "additionalProperties": False},
                {"properties": {"a": {"type": "integer"}, "b": {}}},
            ]
        },
        "allOf",
        False,
    ),
    (
        "allOf with a $ref",
        {
            "$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 15}}}},
            "allOf": [{"$ref": "#/$defs/base"}, {"required": ["a"]}],
        },
        "allOf",
        True,
    ),
    (
        "anyOf beside properties",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
        },
        "anyOf",
        True,
    ),
    (
        "oneOf beside required",
        {
            "required": ["kind"],
            "oneOf": [{"properties": {"kind": {"const": "x"}}}, {"properties": {"kind": {"const": "y"}}}],
        },
        "anyOf",
        False,
    ),
    (
        "dependentRequired",
        {"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "dependentRequired": {"a": ["b"], "b": ["c"]}},
        "dependencies",
        True,
    ),
    (
        "dependentRequired without a type",
        {"dependentRequired": {"a": ["b"]}},
        "dependencies",
        False,
    ),
    (
        "dependentSchemas",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {}},
            "dependentSchemas": {"a": {"properties": {"b": {"type": "integer"}}, "required": ["b"]}},
        },
        "dependencies",
        True,
    ),
    (
        "draft-7 dependencies, list and schema",
        {
            "$schema": DRAFT7,
            "properties": {"a": {}, "b": {}, "c": {"type": "integer"}},
            "dependencies": {"a": ["b"], "c": {"properties": {"a": {"type": "integer", "maximum": 5}}}},
        },
        "dependencies",
        False,
    ),
    (
        "enum beside assertions no engine enforces",
        {"type": "number", "multipleOf": 5, "not": {"multipleOf": 2}, "enum": [1, 2, 5, 10, 15, 20, 2.5, "5"]},
        "enum",
        True,
    ),
    (
        "const beside a format and a $ref",
        {"$defs": {"d": {"format": "date"}}, "$ref": "#/$defs/d", "const": "2020-02-28"},
        "enum",
        False,
    ),
    (
        "a bounded integer beside not",
        {"type": "integer", "minimum": -3, "exclusiveMaximum": 20, "multipleOf": 2, "not": {"enum": [4, 8]}},
        "integers",
        True,
    ),
    (
        "a bounded integer beside if/then and a $ref",
        {
            "$defs": {"d": {"not": {"const": 3}}},
            "$ref": "#/$defs/d",
            "type": "integer",
            "minimum": 0,
            "maximum": 12,
            "if": {"minimum": 5},
            "then": {"multipleOf": 3},
        },
        "integers",
        False,
    ),
    (
        "a dependency on an undeclared name, strict",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "dependencies": {"a": ["c"]}},
        "dependencies",
        True,
    ),
]


@pytest.mark.parametrize(("name", "schema", "rule", "strict"), UNIT, ids=[u[0] for u in UNIT])
def test_rule_keeps_the_language(name: str, schema: dict[str, Any], rule: str, strict: bool) -> None:
    rewritten, rules = rewrite_exact(schema, strict=strict)
    assert rule in rules, (name, rewritten)
    if strict:
        # Under strict mode the rewrite is never wider than xgrammar's strict reading.
        _no_strict_lie(schema, rewritten, PROBES, name)
    else:
        _same_verdicts(schema, rewritten, PROBES, name)


def _no_strict_lie(original: Any, rewritten: Any, instances: list[Any], where: str) -> None:
    """What the rewrite accepts under each engine's strict reading passes the end check against
    the original (the check the orchestrator runs on every output). An engine enforces the
    rewrite as written and closes its objects, never inside an assertion (``not``...): the
    same two validators the end check builds, here for the rewrite."""
    checker = OutputChecker()
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(original), strict=True)
    as_written = _validator(rewritten)
    for engine, reading in (("xgrammar", strict_schema), ("llguidance", llguidance_strict)):
        closed = _validator(reading(without_assertions(rewritten)))
        for instance in instances:
            if as_written.is_valid(instance) and closed.is_valid(instance):
                verdict = checker.check(spec, json.dumps(instance), engine)
                assert verdict.ok, (where, engine, instance, verdict.reason, rewritten)


def test_enum_filter_values() -> None:
    """The values the end check would pass, and nothing else (decimal multipleOf, formats)."""
    schema = {"type": "number", "multipleOf": 0.01, "not": {"const": 1}, "enum": [10000.89, 0.3, 1, 0.005]}
    assert rewrite_exact(schema, strict=True)[0] == {"enum": [10000.89, 0.3]}
    dates = {"type": "string", "format": "date", "not": {"const": "2020-01-01"}, "enum": ["2020-02-30", "2020-02-29"]}
    assert rewrite_exact(dates, strict=True)[0] == {"enum": ["2020-02-29"]}
    objects = {"type": "object", "not": {"required": ["a"]}, "enum": [{"a": 1}, {"b": 1}]}
    assert rewrite_exact(objects, strict=True)[1] == ()  # strict mode would read objects differently


def test_enum_filter_reads_multiple_of_as_the_end_check() -> None:
    """The filter's decimal multipleOf (the grammar layer's copy) and the end check's agree."""
    from specmask.mask_service.grammar import enum_filter
    from specmask.orchestrator import output_check

    for divisor in (0.01, 0.1, 3, 2.5, 1e-3):
        schema = {"multipleOf": divisor}
        ours = enum_filter.exact_multiples(jsonschema.Draft202012Validator)(schema)
        theirs = output_check.exact_multiples(jsonschema.Draft202012Validator)(schema)
        for value in (10000.89, 0.3, 1, 7.5, 0.005, 12, -0.02, 1e-3, 2.675):
            assert ours.is_valid(value) == theirs.is_valid(value), (divisor, value)


INTEGRAL_UNIONS: list[tuple[str, dict[str, Any]]] = [
    (
        "a number made integral by an anyOf of multipleOf, bounds and not in allOf branches",
        {
            "type": "number",
            "allOf": [
                {"$ref": "#/$defs/m"},
                {"exclusiveMinimum": -50},
                {"exclusiveMaximum": 0},
                {"anyOf": [{"not": {"multipleOf": 3}}, {"multipleOf": 7}]},
            ],
            "$defs": {"m": {"anyOf": [{"multipleOf": 4}, {"multipleOf": 10}]}},
        },
    ),
    (
        "integers under a oneOf",
        {"type": "integer", "minimum": 0, "maximum": 40, "oneOf": [{"multipleOf": 3}, {"multipleOf": 5}]},
    ),
    (
        "a number with an integral multipleOf",
        {"type": "number", "multipleOf": 5, "minimum": 0, "maximum": 50, "not": {"const": 25}},
    ),
    (
        "integral through a $ref chain and a float multipleOf",
        {
            "type": "number",
            "minimum": -20,
            "maximum": 20,
            "allOf": [{"$ref": "#/$defs/a"}],
            "not": {"enum": [4, -8.0]},
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"multipleOf": 2.0}},
        },
    ),
]
NUMBERS: list[Any] = [*range(-60, 61), *(x / 4 for x in range(-240, 241)), "5", None, [4]]


@pytest.mark.parametrize(("name", "schema"), INTEGRAL_UNIONS, ids=[u[0] for u in INTEGRAL_UNIONS])
def test_integer_enumeration_through_unions(name: str, schema: dict[str, Any]) -> None:
    """A number every instance of which is an integer (type, an integral multipleOf, a union or
    $ref of them) becomes the enum of the integers that pass: the same verdict on every integer
    and non-number, no non-integral number; an integral float (5.0) may only lose (spelling)."""
    rewritten, rules = rewrite_exact(schema, strict=True)
    assert "integers" in rules and set(rewritten) - {"$defs"} == {"enum"}, (name, rewritten)
    before, after = _validator(schema), _validator(rewritten)
    for value in NUMBERS:
        if isinstance(value, float) and value.is_integer():
            assert not after.is_valid(value) or before.is_valid(value), (name, value)
        else:
            assert before.is_valid(value) == after.is_valid(value), (name, value)


def test_integer_enumeration_needs_integral_numbers() -> None:
    """Left alone: a number that may be a fraction, a union with one branch that may be, and a
    draft 7 $ref whose siblings (the numeric type among them) the end check ignores."""
    fraction = {"type": "number", "minimum": 0, "maximum": 10, "not": {"const": 5}}
    one_open = {
        "type": "number",
        "minimum": 0,
        "maximum": 10,
        "anyOf": [{"multipleOf": 2}, {"minimum": 3}],
        "not": {"const": 4},
    }
    draft7 = {
        "$schema": DRAFT7,
        "$ref": "#/definitions/m",
        "type": "integer",
        "minimum": 0,
        "maximum": 9,
        "not": {"const": 3},
        "definitions": {"m": {"multipleOf": 2}},
    }
    for schema in (fraction, one_open, draft7):
        assert "integers" not in rewrite_exact(schema, strict=True)[1], schema
    assert _validator(draft7).is_valid("a string: the $ref alone is read")


def test_integer_enumeration_bounds() -> None:
    """Exclusive and fractional bounds give the right integers; unbounded or huge ranges are left alone."""
    schema = {"type": "integer", "exclusiveMinimum": 1.5, "maximum": 9.9, "not": {"const": 5}}
    assert rewrite_exact(schema, strict=True)[0] == {"enum": [2, 3, 4, 6, 7, 8, 9]}
    assert rewrite_exact({"type": "integer", "minimum": 0, "not": {"const": 5}}, strict=True)[1] == ()
    huge = {"type": "integer", "minimum": 0, "maximum": 10**6, "not": {"const": 5}}
    assert rewrite_exact(huge, strict=True)[1] == ()
    plain = {"type": "integer", "minimum": 0, "maximum": 10}  # both engines enforce it as it is
    assert rewrite_exact(plain, strict=True)[1] == ()


def test_declared_draft_that_ignores_a_keyword_drops_it() -> None:
    """``dependencies`` under 2020-12 and ``dependentRequired`` under draft 7 are annotations."""
    new = {"$schema": "https://json-schema.org/draft/2020-12/schema", "dependencies": {"a": ["b"]}}
    assert rewrite_exact(new, strict=False)[0] == {"$schema": new["$schema"]}
    old = {"$schema": DRAFT7, "dependentRequired": {"a": ["b"]}}
    assert rewrite_exact(old, strict=False)[0] == {"$schema": DRAFT7}


@pytest.mark.parametrize(
    "schema",
    [
        # A reference into the properties a merge would change.
        {
            "allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"a": {"minimum": 1}}}],
            "properties": {"a": {}},
            "$defs": {"x": {"$ref": "#/properties/a"}},
        },
        # Anchors and $id below the root change what a reference means once copied.
        {"allOf": [{"type": "string"}, {"minLength": 1}], "$defs": {"x": {"$id": "x.json", "type": "string"}}},
        # unevaluatedProperties reads annotations the subschemas produce.
        {"allOf": [{"properties": {"a": {}}}], "unevaluatedProperties": False},
    ],
)
def test_left_alone(schema: dict[str, Any]) -> None:
    rewritten, rules = rewrite_exact(schema, strict=False)
    if rules:  # only the part no reference points into may change
        assert rewritten["properties"] == schema["properties"]
    else:
        assert rewritten == schema


def test_merge_that_is_not_exact_is_declined() -> None:
    """Two patterns, tuple items against items, two anyOf, a split if/then: left in the allOf
    (the anyOf may then be distributed around it)."""
    for branches in (
        [{"pattern": "^a"}, {"pattern": "b$"}],
        [{"prefixItems": [{"type": "integer"}]}, {"items": {"type": "string"}}],
        [{"anyOf": [{"type": "string"}, {"type": "null"}]}, {"anyOf": [{"type": "null"}, {"type": "integer"}]}],
        [{"if": {"type": "string"}}, {"then": {"minLength": 2}}],
    ):
        rewritten, _ = rewrite_exact({"allOf": branches}, strict=False)
        assert "allOf" in json.dumps(rewritten), branches
        _same_verdicts({"allOf": branches}, rewritten, [*PROBES, [1, "a"], ["a"], "b", "ab"], str(branches))


def _suite_groups() -> list[tuple[str, Any, list[tuple[Any, bool]]]]:
    base = shared_data_dir()
    if base is None:
        pytest.skip("shared data not found")
    out = []
    for name, draft in SUITE_FILES:
        path: Path = require(base, "json-schema-test-suite", draft, f"{name}.json")
        for group in json.loads(path.read_text()):
            schema = group["schema"]
            if draft == "draft7" and isinstance(schema, dict) and "$schema" not in schema:
                schema = {"$schema": DRAFT7, **schema}
            tests = [(t["data"], bool(t["valid"])) for t in group["tests"]]
            out.append((f"{draft}/{name}: {group['description']}", schema, tests))
    return out


def test_suite_verdicts() -> None:
    """Every test-suite group a rule changes keeps every labelled verdict; each rule changes some."""
    counts = dict.fromkeys(RULES, 0)
    for where, schema, tests in _suite_groups():
        rewritten, rules = rewrite_exact(schema, strict=False)
        for rule in rules:
            counts[rule] += 1
        if not rules:
            continue
        after = _validator(rewritten)
        for instance, valid in tests:
            assert after.is_valid(instance) == valid, (where, instance, rewritten)
    assert counts["allOf"] >= 10 and counts["dependencies"] >= 10, counts


def test_maskbench_verdicts() -> None:
    """Every maskbench schema a rule changes: the same verdict for each labelled instance (as
    written), and in strict mode (the service's default) no instance the rewrite accepts fails
    the end check."""
    base = shared_data_dir()
    if base is None:
        pytest.skip("shared data not found")
    changed = 0
    for f in sorted(require(base, "maskbench").glob("*.json")):
        text = f.read_text()
        if not any(
            f'"{k}' in text
            for k in ("allOf", "anyOf", "oneOf", "dependencies", "dependent", "enum", "const", "not", "multipleOf")
        ):
            continue
        doc = json.loads(text)
        schema, instances = doc["schema"], [t["data"] for t in doc["tests"]]
        loose, rules = rewrite_exact(schema, strict=False)
        if rules:
            changed += 1
            _same_verdicts(schema, loose, instances, f.name)
        strict, rules = rewrite_exact(schema, strict=True)
        if rules:
            _no_strict_lie(schema, strict, instances, f.name)
    assert changed > 50


def _accepts(engine: Any, compiled: Any, hf_tok: Any, stop: int, text: str) -> bool:
    matcher = engine.new_matcher(compiled)
    for t in [*hf_tok.encode(text, add_special_tokens=False), stop]:
        if not matcher.accept_token(t):
            return False
    return bool(matcher.is_terminated())


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_engines_enforce_the_suite_exactly(registry: TokenizerRegistry, bpe_id: str, hf_tok: Any, backend: str) -> None:
    """The rewritten test-suite groups on each engine: invalid instances refused, valid ones
    accepted (in their own key order or the schema's), exactly as ``jsonschema`` judges them."""
    auto = BACKENDS["auto"]
    compilers = auto.make_compiler(registry.info(bpe_id, None), 1)
    stop = int(registry.info(bpe_id, None).stop_token_ids[0])
    served = 0
    for where, schema, tests in _suite_groups():
        rewritten, rules = rewrite_exact(schema, strict=False)
        if not rules:
            continue
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), strict=False, backend=backend)
        try:
            selected = auto.compile(compilers, spec)
        except MaskError:
            continue
        served += 1
        for instance, valid in tests:
            # Its own key order, the schema's, and the rewrite's (which appends the names it declares).
            texts = [*serializations(instance, schema), *serializations(instance, rewritten)]
            ok = any(_accepts(auto, selected, hf_tok, stop, t) for t in texts)
            assert ok == valid, (backend, where, instance)
    assert served >= 10, served
