"""unsatisfiable: schemas proven to have no valid instance are refused before any engine, and a
schema with a valid instance never is.

Evidence:

* unit cases per rule: each refused schema rejects every probe value under ``jsonschema``, and
  a near miss of it (one bound moved, another draft's reading, one branch changed) is not
  refused and accepts a witness;
* the shared data: no maskbench schema with a valid test instance, and no JSON-Schema-Test-Suite
  group with a valid test (2020-12, and draft 7 read as draft 7), is refused; the unsatisfiable
  maskbench schemas that exhausted checked mode are;
* random schemas: whatever is refused rejects every probe under ``jsonschema``;
* the service over real gRPC: ``INVALID_ARGUMENT`` with the reason, in checked mode too.
"""

from __future__ import annotations

import json
import random
from typing import Any

import grpc
import jsonschema
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import MaskServiceClient, MaskServiceError
from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.grammar_checks import precheck
from specmask.mask_service.grammar.unsatisfiable import why_unsatisfiable
from tests.fixtures.shared_data import require, shared_data_dir

DRAFT4 = "http://json-schema.org/draft-04/schema#"
DRAFT7 = "http://json-schema.org/draft-07/schema#"

PROBES: list[Any] = [None, True, False, 0, 1, -1, 1.0, 0.5, 2.5, -3, 5, 10, 12, 15, 60, 99, -99, 1e9, "", "a", "abc"]
PROBES += [[], [1], [1, 2, 3], [[]], ["a"], {}, {"a": 1}, {"a": 1, "b": 2}, {"a": "x"}, {"b": 1}]
PROBES += [{"a": 1, "b": 2, "c": 3}, {"radius": 1, "length": 2, "width": 3, "base": 4, "height": 5}]


def _valid(schema: Any, instance: Any) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return bool(cls(schema).is_valid(instance))


AREA = {
    "type": "object",
    "properties": {
        "dimensions": {
            "type": "object",
            "properties": {k: {"type": "number"} for k in ("radius", "length", "width", "base", "height")},
            "required": ["radius", "length", "width", "base", "height"],
            "oneOf": [{"required": ["radius"]}, {"required": ["length", "width"]}, {"required": ["base", "height"]}],
        },
        "shape": {"enum": ["circle", "rectangle", "triangle"]},
    },
    "required": ["shape", "dimensions"],
}
AREA_OPTIONAL = {**AREA, "required": ["shape"]}
AREA_ONE_FREE = json.loads(json.dumps(AREA))
AREA_ONE_FREE["properties"]["dimensions"]["required"] = ["radius", "length"]

# (name, schema the rules refuse, a near miss they do not refuse, a value valid for the near miss)
CASES: list[tuple[str, Any, Any, Any]] = [
    ("oneOf of implied required", AREA, AREA_ONE_FREE, {"shape": "circle", "dimensions": {"radius": 1, "length": 2}}),
    ("oneOf of implied required, property optional", AREA, AREA_OPTIONAL, {"shape": "circle"}),
    ("oneOf of two empty branches", {"oneOf": [{}, {"description": "x"}]}, {"oneOf": [{}, {"type": "string"}]}, 1),
    (
        "oneOf of two covering types",
        {"type": "string", "oneOf": [{"type": "string"}, {"type": ["string", "null"]}]},
        {"type": "string", "oneOf": [{"type": "string"}, {"type": "null"}]},
        "a",
    ),
    (
        "numbers: minimum above maximum",
        {"type": "number", "minimum": 5, "maximum": 1},
        {"minimum": 5, "maximum": 1},
        "a",
    ),
    (
        "numbers: exclusive bounds meet",
        {"type": "number", "exclusiveMinimum": 1, "maximum": 1},
        {"type": "number", "minimum": 1, "maximum": 1},
        1,
    ),
    (
        "draft 4 exclusive flag",
        {"$schema": DRAFT4, "type": "number", "minimum": 1, "maximum": 1, "exclusiveMinimum": True},
        {"$schema": DRAFT4, "type": "number", "minimum": 1, "maximum": 1, "exclusiveMinimum": False},
        1,
    ),
    (
        "no integer in the bounds",
        {"type": "integer", "minimum": 0.5, "maximum": 0.7},
        {"type": "number", "minimum": 0.5, "maximum": 0.7},
        0.6,
    ),
    (
        "no multiple in the bounds",
        {"type": "number", "multipleOf": 0.5, "minimum": 0.6, "maximum": 0.9},
        {"type": "number", "multipleOf": 0.5, "minimum": 0.1, "maximum": 0.6},
        0.5,
    ),
    (
        "no integral multiple",
        {"type": "integer", "multipleOf": 1.5, "minimum": 1, "maximum": 2},
        {"type": "integer", "multipleOf": 1.5, "minimum": 1, "maximum": 3},
        3,
    ),
    (
        "integral multipleOf, fraction bounds",
        {"type": "number", "multipleOf": 7, "exclusiveMinimum": 0, "maximum": 6.9},
        {"type": "number", "multipleOf": 7, "exclusiveMinimum": 0, "maximum": 7},
        7,
    ),
    (
        "strings: minLength above maxLength",
        {"type": "string", "minLength": 3, "maxLength": 2},
        {"type": ["string", "null"], "minLength": 3, "maxLength": 2},
        None,
    ),
    (
        "arrays: minItems above maxItems",
        {"type": "array", "minItems": 3, "maxItems": 2},
        {"type": "array", "minItems": 2, "maxItems": 2},
        [1, 2],
    ),
    (
        "arrays: a required item of no value",
        {"type": "array", "items": False, "minItems": 1},
        {"type": "array", "items": False},
        [],
    ),
    (
        "arrays: a tuple position below minItems",
        {"type": "array", "prefixItems": [{}, False], "minItems": 2},
        {"type": "array", "prefixItems": [{}, False], "minItems": 1},
        [1],
    ),
    (
        "draft 7: prefixItems is not a keyword",
        {"type": "array", "items": [{}, False], "minItems": 2, "$schema": DRAFT7},
        {"type": "array", "prefixItems": [{}, False], "minItems": 2, "$schema": DRAFT7},
        [1, 2],
    ),
    (
        "contains nothing",
        {"type": "array", "contains": False},
        {"type": "array", "contains": False, "minContains": 0},
        [],
    ),
    (
        "draft 7: minContains is not a keyword",
        {"type": "array", "contains": False, "minContains": 0, "$schema": DRAFT7},
        {"type": "array", "contains": {"enum": [1]}, "$schema": DRAFT7},
        [1],
    ),
    (
        "minContains above maxContains",
        {"type": "array", "contains": {}, "minContains": 2, "maxContains": 1},
        {"type": "array", "contains": {}, "minContains": 1, "maxContains": 1},
        [1],
    ),
    (
        "required but additionalProperties false",
        {"type": "object", "additionalProperties": False, "required": ["a"]},
        {"type": "object", "additionalProperties": False, "patternProperties": {"^a$": {}}, "required": ["a"]},
        {"a": 1},
    ),
    (
        "required but declared false",
        {"type": "object", "properties": {"x": False}, "required": ["x"]},
        {"type": "object", "properties": {"x": False}, "required": ["y"]},
        {"y": 1},
    ),
    (
        "more required than maxProperties",
        {"type": "object", "required": ["a", "b"], "maxProperties": 1},
        {"type": "object", "required": ["a"], "maxProperties": 1},
        {"a": 1},
    ),
    (
        "minProperties above maxProperties",
        {"type": "object", "minProperties": 2, "maxProperties": 1},
        {"minProperties": 2, "maxProperties": 1},
        3,
    ),
    ("enum: no value passes", {"enum": ["a", "bb"], "minLength": 3}, {"enum": ["a", "bbb"], "minLength": 3}, "bbb"),
    (
        "enum: no value has the type",
        {"type": "integer", "enum": ["1", 1.5]},
        {"type": "integer", "enum": ["1", 1.0]},
        1,
    ),
    ("const fails its siblings", {"const": 3, "multipleOf": 2}, {"const": 4, "multipleOf": 2}, 4),
    (
        "draft 4: const is not a keyword",
        {"const": 3, "multipleOf": 2},
        {"$schema": DRAFT4, "const": 3, "multipleOf": 2},
        4,
    ),
    ("not of everything", {"not": {"description": "any"}}, {"not": {"minimum": 1}}, 0),
    (
        "not of its own type",
        {"type": "string", "not": {"type": "string"}},
        {"type": "string", "not": {"type": "null"}},
        "a",
    ),
    (
        "draft 4: not integer keeps 1.0",
        {"type": "number", "multipleOf": 1, "not": {"type": "number"}},
        {"$schema": DRAFT4, "type": "number", "multipleOf": 1, "not": {"type": "integer"}},
        1.0,
    ),
    (
        "no integer in the bounds passes a not",
        {"type": "integer", "minimum": 0, "maximum": 3, "not": {"enum": [0, 1, 2, 3]}},
        {"type": "integer", "minimum": 0, "maximum": 4, "not": {"enum": [0, 1, 2, 3]}},
        4,
    ),
    (
        "no integral multiple passes a oneOf",
        {
            "type": "number",
            "multipleOf": 2,
            "exclusiveMinimum": 0,
            "maximum": 6,
            "oneOf": [{"multipleOf": 1}, {"multipleOf": 2}],
        },
        {"type": "integer", "exclusiveMinimum": 0, "maximum": 6, "oneOf": [{"multipleOf": 1}, {"multipleOf": 2}]},
        1,
    ),
    ("allOf with a false branch", {"allOf": [{}, False]}, {"anyOf": [{}, False]}, 1),
    (
        "anyOf of nothing",
        {"anyOf": [{"type": "string", "maxLength": 1, "minLength": 2}, False]},
        {"anyOf": [{"type": "string", "maxLength": 1, "minLength": 1}, False]},
        "a",
    ),
    (
        "$ref siblings apply (2020-12)",
        {"$ref": "#/$defs/i", "type": "string", "$defs": {"i": {"type": "integer"}}},
        {"$ref": "#/definitions/i", "type": "string", "definitions": {"i": {"type": "integer"}}, "$schema": DRAFT7},
        1,
    ),
    (
        "$ref to false",
        {"properties": {"a": {"$ref": "#/$defs/no"}}, "required": ["a"], "type": "object", "$defs": {"no": False}},
        {"properties": {"a": {"$ref": "#/$defs/no"}}, "type": "object", "$defs": {"no": False}},
        {},
    ),
]


@pytest.mark.parametrize(("name", "refused", "near", "witness"), CASES, ids=[c[0] for c in CASES])
def test_refused_schema_has_no_instance_and_its_near_miss_is_served(
    name: str, refused: Any, near: Any, witness: Any
) -> None:
    why = why_unsatisfiable(refused)
    assert why, name
    for probe in PROBES:
        assert not _valid(refused, probe), (name, probe)
    assert why_unsatisfiable(near) is None, (name, why_unsatisfiable(near))
    assert _valid(near, witness), (name, witness)
    with pytest.raises(GrammarError, match="matches nothing") as info:
        precheck(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(refused), checked=True))
    assert why in info.value.message


def test_a_cycle_or_remote_ref_proves_nothing() -> None:
    assert why_unsatisfiable({"$ref": "#"}) is None  # check_language refuses it after the compile
    assert why_unsatisfiable({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a", "required": ["x"]}) is None
    assert why_unsatisfiable({"$ref": "https://example.com/s.json", "type": "string"}) is None
    # An $id below the root moves what "#/..." means to the end check: no proof through references.
    assert why_unsatisfiable({"$defs": {"a": {"$id": "a", "not": {}}}, "allOf": [{"$ref": "#/$defs/a"}]}) is None


def _maskbench() -> list[tuple[str, Any, list[Any]]]:
    base = shared_data_dir()
    if base is None:
        pytest.skip("shared data not found")
    out = []
    for path in sorted(require(base, "maskbench").glob("*.json")):
        doc = json.loads(path.read_text())
        out.append((path.stem, doc["schema"], [t["data"] for t in doc.get("tests", []) if t.get("valid")]))
    return out


def test_no_maskbench_schema_with_a_valid_instance_is_refused() -> None:
    refused = []
    for name, schema, valid in _maskbench():
        why = why_unsatisfiable(schema)
        if why is None:
            continue
        refused.append(name)
        assert not valid, (name, why, valid[:1])
        for probe in PROBES:
            assert not _valid(schema, probe), (name, probe)
    # The unsatisfiable schema checked mode spent every attempt on, and its siblings.
    assert "Glaiveai2K---calculate_area_92ac029d" in refused
    assert all(n.startswith("Glaiveai2K---calculate_area_") for n in refused), refused


@pytest.mark.parametrize("draft", ["draft2020-12", "draft7"])
def test_no_suite_group_with_a_valid_test_is_refused(draft: str) -> None:
    base = shared_data_dir()
    if base is None:
        pytest.skip("shared data not found")
    refused = 0
    for path in sorted(require(base, "json-schema-test-suite", draft).rglob("*.json")):
        for group in json.loads(path.read_text()):
            schema = group["schema"]
            if draft == "draft7" and isinstance(schema, dict) and "$schema" not in schema:
                schema = {"$schema": DRAFT7, **schema}
            why = why_unsatisfiable(schema)
            if why is None:
                continue
            refused += 1
            valid = [t["data"] for t in group["tests"] if t["valid"]]
            assert not valid, (path.name, group["description"], why)
            for t in group["tests"]:
                assert not _valid(schema, t["data"]), (path.name, group["description"], t["data"])
    assert refused >= 8, refused  # false, not {}, oneOf of true branches, empty enum...


def _random_schema(rng: random.Random, depth: int = 0) -> Any:
    """A small schema from the keywords the rules read (bounds near each other, shared names)."""
    if depth > 2 or rng.random() < 0.1:
        return rng.choice([True, False, {}])
    node: dict[str, Any] = {}
    if rng.random() < 0.6:
        node["type"] = rng.choice(["integer", "number", "string", "object", "array", "null", ["string", "integer"]])
    for low, high in (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems")):
        if rng.random() < 0.3:
            node[low] = rng.randint(0, 4)
        if rng.random() < 0.3:
            node[high] = rng.randint(0, 4)
    if rng.random() < 0.2:
        node["exclusiveMinimum" if rng.random() < 0.5 else "exclusiveMaximum"] = rng.choice([0, 1, 2.5])
    if rng.random() < 0.2:
        node["multipleOf"] = rng.choice([2, 3, 0.5, 1.5])
    if rng.random() < 0.25:
        node["required"] = rng.sample(["a", "b", "c"], rng.randint(1, 2))
    if rng.random() < 0.2:
        node["properties"] = {"a": _random_schema(rng, depth + 1)}
    if rng.random() < 0.15:
        node["additionalProperties"] = rng.choice([False, True])
    if rng.random() < 0.15:
        node["items"] = _random_schema(rng, depth + 1)
    if rng.random() < 0.1:
        node["contains"] = _random_schema(rng, depth + 1)
    if rng.random() < 0.15:
        node["enum"] = rng.sample([0, 1, 2, 1.5, "a", "abc", None, [], {}], rng.randint(1, 3))
    if rng.random() < 0.1:
        node["not"] = _random_schema(rng, depth + 1)
    for key in ("allOf", "anyOf", "oneOf"):
        if rng.random() < 0.15:
            node[key] = [_random_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]
    return node


def test_random_refused_schemas_reject_every_probe() -> None:
    rng = random.Random(20261128)
    extra = [{"a": 0}, {"a": "abc"}, {"c": 1.5}, [0, 1.5], ["abc", 2], 2, 3, 4, 1.5, 3.0, "ab", "abcd"]
    refused = 0
    for _ in range(3000):
        schema = _random_schema(rng)
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError:
            continue
        if why_unsatisfiable(schema) is None:
            continue
        refused += 1
        for probe in [*PROBES, *extra]:
            assert not _valid(schema, probe), (schema, probe)
    assert refused >= 100, refused


def test_service_refuses_it_in_checked_mode_too(client: MaskServiceClient, bpe_id: str) -> None:
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(AREA), checked=True)
    with pytest.raises(MaskServiceError) as info:
        client.validate_grammar(bpe_id, spec)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "matches nothing" in info.value.message and "oneOf branches 0 and 1" in info.value.message
    # Its near miss (one branch implied, the others not) is served.
    client.validate_grammar(bpe_id, GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(AREA_ONE_FREE), checked=True))


def test_shared_references_cost_no_more_than_a_tree() -> None:
    """40 levels of definitions, each referencing the next twice (2**40 paths): the walks that
    read references (this module, the integers rule, the relaxation's oneOf types) visit each
    target a bounded number of times, so they finish at once instead of never."""
    import time

    from specmask.mask_service.grammar.exact_rewrites import rewrite_exact
    from specmask.mask_service.grammar.schema_relax import relax_schema

    defs: dict[str, Any] = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}]}]}
        for i in range(40)
    }
    defs["d40"] = {"multipleOf": 2}
    schema = {
        "$defs": defs,
        "type": "number",
        "minimum": 0,
        "maximum": 8,
        "allOf": [{"$ref": "#/$defs/d0"}],
        "oneOf": [{"$ref": "#/$defs/d0"}, {"not": {"const": 3}}],
    }
    started = time.monotonic()
    assert why_unsatisfiable(schema) is None
    rewrite_exact(schema, strict=True)
    relax_schema(schema)
    assert time.monotonic() - started < 60  # unbounded, the walks would take hours
