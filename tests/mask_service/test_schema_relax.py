"""Checked mode's relaxation: every rule only widens, and only an opt-in request gets it.

Widening is checked on instances: each rule comes with instances the original
schema accepts (all must pass the relaxed schema) and at least one it rejects
that the relaxed schema accepts (the rule really relaxes something).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.backends import SelectingBackend
from specmask.mask_service.grammar.schema_relax import RELAXATIONS, relax_schema
from specmask.mask_service.server.tokenizers import TokenizerRegistry

# rule -> (schema, instances to try); the instances mix ones the original accepts and rejects.
CASES: dict[str, tuple[Any, list[Any]]] = {
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [[1, 2], [1, 1], [], ["a"]]),
    "not": ({"type": "string", "not": {"enum": ["no"]}}, ["yes", "no", 3]),
    "oneOf": (
        {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
        [1, -1, 1.5, -1.5, 5, "x"],
    ),
    "dependencies": (
        {
            "$schema": "http://json-schema.org/draft-07/schema#",  # 2020-12 no longer defines it
            "type": "object",
            "dependencies": {"a": ["b"], "c": {"required": ["d"]}},
        },
        [{}, {"a": 1}, {"a": 1, "b": 2}, {"c": 1}, {"c": 1, "d": 1}, []],
    ),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, [{}, {"a": 1}, {"a": 1, "b": 1}]),
    "dependentSchemas": (
        {"type": "object", "dependentSchemas": {"a": {"properties": {"b": {"type": "string"}}}}},
        [{}, {"a": 1, "b": "x"}, {"a": 1, "b": 2}, {"b": 2}],
    ),
    "if": (
        {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}, "else": {"required": ["c"]}},
        [{"a": 1, "b": 1}, {"a": 1}, {"c": 1}, {}],
    ),
    "contains": (
        {"type": "array", "contains": {"type": "string"}, "minContains": 2, "maxContains": 3},
        [["a", "b"], ["a"], [1, 2], ["a", "b", "c", "d"]],
    ),
}
# then/else/minContains/maxContains trigger the same rules as if/contains.
ALIASES = {"then": "if", "else": "if", "minContains": "contains", "maxContains": "contains"}


def _valid(schema: Any, instance: Any) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema).is_valid(instance)


def test_every_rule_has_a_case() -> None:
    assert set(RELAXATIONS) == set(CASES) | set(ALIASES)


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_only_widens(rule: str) -> None:
    schema, instances = CASES[rule]
    before = json.dumps(schema)
    relaxed, applied = relax_schema(schema)
    assert json.dumps(schema) == before  # the input is not changed
    assert rule in applied
    widened = 0
    for inst in instances:
        if _valid(schema, inst):
            assert _valid(relaxed, inst), (rule, inst)
        elif _valid(relaxed, inst):
            widened += 1
    assert widened, f"{rule}: no instance shows the relaxation"
    # Nested under properties/items/$defs, next to other keywords: still only wider.
    nested = {
        **({"$schema": schema["$schema"]} if "$schema" in schema else {}),
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/d"}, "y": {"type": "array", "items": schema}},
        "$defs": {"d": schema},
    }
    nested_relaxed, nested_applied = relax_schema(nested)
    assert rule in nested_applied
    for inst in instances:
        doc = {"x": inst, "y": [inst]}
        if _valid(nested, doc):
            assert _valid(nested_relaxed, doc)


def test_one_of_next_to_any_of_becomes_a_conjunction() -> None:
    schema = {"anyOf": [{"type": "integer"}, {"type": "string"}], "oneOf": [{"minimum": 0}, {"maximum": 10}]}
    relaxed, _ = relax_schema(schema)
    assert "oneOf" not in relaxed and relaxed["anyOf"] == schema["anyOf"]
    assert relaxed["allOf"] == [{"anyOf": schema["oneOf"]}]
    for inst in (5, -5, 50, "s", None):
        if _valid(schema, inst):
            assert _valid(relaxed, inst)
    assert _valid(relaxed, 5) and not _valid(schema, 5)


DRAFT4 = "http://json-schema.org/draft-04/schema#"
DRAFT7 = "http://json-schema.org/draft-07/schema#"
PROBES: list[Any] = [
    None,
    True,
    0,
    7,
    1.5,
    "x",
    "",
    [],
    [1],
    [1, 2],
    ["a"],
    ["a", "b"],
    [5, 50],
    {},
    {"a": 1},
    {"b": 1},
]
PROBES += [{"a": 1, "b": 2}, [[]], [[1]], ["a", 1], [0, 10], [60, 70]]

# (name, schema, the relaxed type or minItems expected at the root: None for left alone)
TIGHTER: list[tuple[str, Any, Any, Any]] = [
    (
        "oneOf of item-only branches: no non-array",
        {"oneOf": [{"items": {"maximum": 5}}, {"items": {"minimum": 3}}]},
        "array",
        None,
    ),
    (
        "oneOf of object shapes beside a type",
        {
            "type": ["object", "string", "null"],
            "oneOf": [{"required": ["a"]}, {"properties": {"b": {}}}, {"type": "null"}],
        },
        "object",
        None,
    ),
    (
        "through $ref and allOf",
        {
            "oneOf": [{"$ref": "#/$defs/a"}, {"allOf": [{"minLength": 2}, {"maxItems": 3}]}],
            "$defs": {"a": {"minimum": 1}},
        },
        ["array", "string", "number"],
        None,
    ),
    (
        "integer branches accept no type whole",
        {"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]},
        None,
        None,
    ),
    ("one branch with not", {"oneOf": [{"items": {}}, {"not": {"type": "string"}}]}, None, None),
    (
        "draft 7: the oneOf beside a $ref is not read",
        {
            "$schema": DRAFT7,
            "$ref": "#/definitions/a",
            "oneOf": [{"items": {}}, {"items": {}}],
            "definitions": {"a": {}},
        },
        None,
        None,
    ),
    ("contains with minContains", {"type": "array", "contains": {"type": "string"}, "minContains": 2}, "array", 2),
    ("contains", {"type": "array", "contains": {"type": "string"}}, "array", 1),
    ("contains with minContains 0", {"type": "array", "contains": {"type": "string"}, "minContains": 0}, "array", None),
    ("contains beside a larger minItems", {"contains": {"type": "string"}, "minItems": 3}, None, 3),
    (
        "draft 7: minContains is not read",
        {"$schema": DRAFT7, "contains": {"type": "string"}, "minContains": 2},
        None,
        1,
    ),
    ("draft 4: contains is not read", {"$schema": DRAFT4, "contains": {"type": "string"}}, None, None),
]


@pytest.mark.parametrize(("name", "schema", "kind", "min_items"), TIGHTER, ids=[t[0] for t in TIGHTER])
def test_relaxation_keeps_what_one_of_and_contains_imply(name: str, schema: Any, kind: Any, min_items: Any) -> None:
    """Types two oneOf branches accept whole, and the items contains needs, stay out of the
    relaxation, and it still accepts everything the original does."""
    relaxed, _ = relax_schema(schema)
    assert relaxed.get("type") == kind, (name, relaxed)
    assert relaxed.get("minItems") == min_items, (name, relaxed)
    for inst in PROBES:
        if _valid(schema, inst):
            assert _valid(relaxed, inst), (name, inst, relaxed)
    if kind is not None and kind != schema.get("type"):
        assert any(
            _valid(dict(relaxed, type=schema.get("type", list(TYPE_NAMES))), i) and not _valid(relaxed, i)
            for i in PROBES
        )


TYPE_NAMES = ("null", "boolean", "object", "array", "string", "number")


def test_relaxation_accepts_every_valid_maskbench_instance() -> None:
    """Every schema checked mode could relax, every labelled valid instance: the relaxation passes it."""
    from tests.fixtures.shared_data import require, shared_data_dir

    base = shared_data_dir()
    if base is None:
        pytest.skip("shared data not found")
    relaxed_schemas = 0
    for path in sorted(require(base, "maskbench").glob("*.json")):
        doc = json.loads(path.read_text())
        valid = [t["data"] for t in doc.get("tests", []) if t.get("valid")]
        if not valid or not any(f'"{k}"' in json.dumps(doc["schema"]) for k in RELAXATIONS):
            continue
        try:
            relaxed, applied = relax_schema(doc["schema"])
        except GrammarError:
            continue
        if not applied:
            continue
        relaxed_schemas += 1
        for instance in valid:
            assert _valid(relaxed, instance), (path.stem, instance)
    assert relaxed_schemas >= 300, relaxed_schemas


def test_data_and_property_names_are_not_relaxed() -> None:
    schema = {
        "type": "object",
        "properties": {"not": {"type": "string"}, "oneOf": {"const": {"not": 1}}},
        "default": {"uniqueItems": True},
    }
    assert relax_schema(schema) == (schema, ())  # nothing to relax: no rule names


def test_ref_into_a_relaxed_keyword_is_refused() -> None:
    with pytest.raises(GrammarError, match="points into 'oneOf'"):
        relax_schema({"oneOf": [{"type": "integer"}, {"type": "number"}], "$defs": {"a": {"$ref": "#/oneOf/0"}}})
    # A property *named* like a keyword is not one.
    _, applied = relax_schema(
        {"properties": {"not": {"type": "string"}, "b": {"$ref": "#/properties/not"}}, "uniqueItems": True}
    )
    assert applied == ("uniqueItems",)


def _spec(schema: Any, **kw: Any) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), strict=False, **kw)


def test_selection_relaxes_only_when_opted_in(registry: TokenizerRegistry, bpe_id: str) -> None:
    auto = SelectingBackend()
    compilers = auto.make_compiler(registry.info(bpe_id, None), 1)
    unique = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "uniqueItems": True}
    with pytest.raises(GrammarError, match="uniqueItems") as refused:
        auto.compile(compilers, _spec(unique))  # refused as before without opt-in
    assert "checked mode could serve it" in refused.value.message  # the refusal names the way out
    with pytest.raises(GrammarError) as plain:
        auto.compile(compilers, _spec({"type": "object", "unevaluatedProperties": False}))
    assert "checked mode" not in plain.value.message  # nothing relaxable: no such hint
    got = auto.compile(compilers, _spec(unique, checked=True))
    assert (got.enforcement, got.relaxed, got.backend) == ("checked", ("uniqueItems",), "xgrammar")
    # Explicit engine choice is honoured in checked mode too.
    got = auto.compile(compilers, _spec(unique, checked=True, backend="llguidance"))
    assert (got.enforcement, got.backend) == ("checked", "llguidance")
    # Exactly enforceable: exact, even when opted in.
    exact = auto.compile(compilers, _spec({"type": "integer"}, checked=True))
    assert (exact.enforcement, exact.relaxed) == ("exact", ())
    # Not relaxable: refused in checked mode too, with both reasons.
    with pytest.raises(GrammarError, match="checked mode: its relaxation"):
        auto.compile(
            compilers,
            _spec({"type": "object", "unevaluatedProperties": False, "not": {"required": ["a"]}}, checked=True),
        )
    with pytest.raises(GrammarError, match="unevaluatedProperties"):
        auto.compile(compilers, _spec({"type": "object", "unevaluatedProperties": False}, checked=True))
    with pytest.raises(GrammarError, match="unknown grammar backend"):
        auto.compile(compilers, _spec(unique, checked=True, backend="outlines"))
    # Regex is never relaxed.
    with pytest.raises(GrammarError):
        auto.compile(compilers, GrammarSpec(GrammarKind.REGEX, "(unclosed", checked=True))


def test_checked_is_part_of_the_cache_key() -> None:
    a, b = _spec({"type": "integer"}), _spec({"type": "integer"}, checked=True)
    assert a.cache_key() != b.cache_key()
    assert _spec({"type": "integer"}, backend="x").cache_key() != b.cache_key()


def test_cache_key_is_computed_once_and_follows_replace() -> None:
    import dataclasses

    a = _spec({"type": "integer"})
    first = a.cache_key()
    assert a.cache_key() is first and a._digest() == first  # memoised, and equal to a fresh digest
    assert dataclasses.replace(a, strict=True).cache_key() != first  # a changed field: a new digest
    assert dataclasses.replace(a).cache_key() == first and dataclasses.replace(a) == a


def test_cache_key_separates_every_field_and_takes_any_text() -> None:
    """The digest hashes the text as is after a JSON header of the other fields: every field
    still changes it, a text cannot pose as a header, and a lone surrogate (possible in text
    from an HTTP JSON body) is digested, not an encoding error."""
    texts = ["a", "a\n", '\n["regex"]', "a\ud800", "a\ud801", ""]
    specs = [GrammarSpec(kind, text) for kind in (GrammarKind.REGEX, GrammarKind.EBNF) for text in texts]
    specs += [
        GrammarSpec(GrammarKind.JSON_SCHEMA, "{}", any_whitespace=True),
        GrammarSpec(GrammarKind.JSON_SCHEMA, "{}"),
    ]
    specs += [GrammarSpec(GrammarKind.JSON_SCHEMA, "{}", separators=(", ", ": "))]
    keys = [spec.cache_key() for spec in specs]
    assert len(set(keys)) == len(keys)


def test_service_reports_enforcement(client: Any, bpe_id: str) -> None:
    """Through the real gRPC service: the response says checked (and which rules), the session too."""
    from prometheus_client import REGISTRY

    def validations(enforcement: str) -> float:
        labels = {"backend": "xgrammar", "enforcement": enforcement}
        return REGISTRY.get_sample_value("specmask_mask_grammar_validations_total", labels) or 0.0

    unique = {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}
    before = validations("checked")
    resp = client.validate_grammar(bpe_id, _spec(unique, checked=True))
    assert (resp.backend, resp.enforcement, list(resp.relaxed)) == ("xgrammar", "checked", ["uniqueItems"])
    assert validations("checked") == before + 1
    info = client.open_session_info(bpe_id, _spec(unique, checked=True))
    assert info.enforcement == "checked"
    client.close_session(info.session_id)
    assert client.validate_grammar(bpe_id, _spec({"type": "integer"}, checked=True)).enforcement == "exact"
