"""oneof_disjoint: each rule proves what it claims and nothing more; anyOf then means oneOf.

Unit cases per rule (proven and not proven), the rewrite checked against
``jsonschema`` on the JSON-Schema-Test-Suite's oneOf groups and on every
maskbench schema it changes (each labelled instance must get the same verdict
from the ``oneOf`` original and the ``anyOf`` rewrite), and the engines serving
a union told apart by a closed object.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from bench.oneof_rules import one_ofs
from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.grammar.backends import BACKENDS
from specmask.mask_service.grammar.backends_routing import xgrammar_gap
from specmask.mask_service.grammar.oneof_disjoint import exclusive_rules, oneof_as_anyof
from specmask.mask_service.server.tokenizers import TokenizerRegistry
from specmask.orchestrator.output_check import OutputChecker
from tests.fixtures.shared_data import require, shared_data_dir

OBJ = {"type": "object"}
CASES: list[tuple[str, dict[str, Any], set[str] | None, bool]] = [
    # (name, schema, rules proving it (None: not proven), assume_objects)
    ("types", {"oneOf": [{"type": "string"}, {"type": ["integer", "null"]}]}, {"types"}, False),
    ("integer within number", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, None, False),
    ("values", {"oneOf": [{"enum": ["a", 1]}, {"enum": ["b", True]}]}, {"values"}, False),
    ("1 is 1.0", {"oneOf": [{"const": 1}, {"const": 1.0}]}, None, False),
    ("true is not 1", {"oneOf": [{"const": True}, {"const": 1}]}, {"types"}, False),
    (
        "exclusive ranges",
        {"oneOf": [{"type": "number", "exclusiveMaximum": 1}, {"type": "number", "minimum": 1}]},
        {"ranges"},
        False,
    ),
    (
        "touching ranges",
        {"oneOf": [{"type": "number", "maximum": 1}, {"type": "number", "minimum": 1}]},
        None,
        False,
    ),
    (
        "lengths",
        {"oneOf": [{"type": "string", "maxLength": 2}, {"type": "string", "minLength": 3}]},
        {"ranges"},
        False,
    ),
    (
        "discriminator",
        {
            "type": "object",
            "oneOf": [
                {"required": ["k"], "properties": {"k": {"const": "a"}}},
                {"required": ["k"], "properties": {"k": {"const": "b"}}},
            ],
        },
        {"discriminator"},
        False,
    ),
    (
        "discriminator required by the parent",
        {
            "type": "object",
            "required": ["k"],
            "oneOf": [{"properties": {"k": {"enum": ["a", "c"]}}}, {"properties": {"k": {"enum": ["b"]}}}],
        },
        {"discriminator"},
        False,
    ),
    (
        # Without a type, a string matches both: JSON Schema's reading proves nothing.
        "discriminator without objects",
        {
            "oneOf": [
                {"required": ["k"], "properties": {"k": {"const": "a"}}},
                {"required": ["k"], "properties": {"k": {"const": "b"}}},
            ]
        },
        None,
        False,
    ),
    (
        # xgrammar emits only objects for both branches, and no object matches both.
        "discriminator as xgrammar emits it",
        {
            "oneOf": [
                {"required": ["k"], "properties": {"k": {"const": "a"}}},
                {"required": ["k"], "properties": {"k": {"const": "b"}}},
            ]
        },
        {"discriminator"},
        True,
    ),
    (
        # xgrammar's branch 1 emits objects, but its "x" from branch 2 matches branch 1 too.
        "object keywords beside a string",
        {"oneOf": [{"properties": {"a": {"type": "string"}}}, {"type": "string"}]},
        None,
        True,
    ),
    (
        "closed required",
        {
            "oneOf": [
                {**OBJ, "required": ["a"], "properties": {"a": {}}},
                {**OBJ, "required": ["b"], "properties": {"b": {}}, "additionalProperties": False},
            ]
        },
        {"closed_required"},
        False,
    ),
    (
        "closed but pattern keys",
        {
            "oneOf": [
                {**OBJ, "required": ["a"]},
                {**OBJ, "properties": {"b": {}}, "patternProperties": {"^a": {}}, "additionalProperties": False},
            ]
        },
        None,
        False,
    ),
    (
        "open objects with different required names",
        {"oneOf": [{**OBJ, "required": ["a"]}, {**OBJ, "required": ["b"]}]},
        None,
        False,
    ),
    (
        "property declared false",
        {"oneOf": [{**OBJ, "required": ["a"]}, {**OBJ, "properties": {"a": False}}]},
        {"closed_required"},
        False,
    ),
    (
        "literal prefixes",
        {"oneOf": [{"type": "string", "pattern": "^ab-"}, {"type": "string", "pattern": "^ac"}]},
        {"patterns"},
        False,
    ),
    (
        "one prefix starts the other",
        {"oneOf": [{"type": "string", "pattern": "^ab"}, {"type": "string", "pattern": "^abc"}]},
        None,
        False,
    ),
    (
        "quantified last character",
        {"oneOf": [{"type": "string", "pattern": "^abc?"}, {"type": "string", "pattern": "^abd"}]},
        None,
        False,
    ),
    (
        "alternation",
        {"oneOf": [{"type": "string", "pattern": "^ab|x"}, {"type": "string", "pattern": "^cd"}]},
        None,
        False,
    ),
]


@pytest.mark.parametrize(("name", "schema", "rules", "assume"), CASES, ids=[c[0] for c in CASES])
def test_rules(name: str, schema: dict[str, Any], rules: set[str] | None, assume: bool) -> None:
    assert exclusive_rules(schema, schema, assume_objects=assume) == rules, name


def _same_verdicts(schema: Any, instances: list[Any]) -> None:
    rewritten = oneof_as_anyof(schema)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    original, as_any = cls(schema), cls(rewritten)
    for instance in instances:
        assert original.is_valid(instance) == as_any.is_valid(instance), (schema, instance)


@pytest.mark.parametrize(("name", "schema", "rules", "assume"), CASES, ids=[c[0] for c in CASES])
def test_rewrite_keeps_the_language(name: str, schema: dict[str, Any], rules: set[str] | None, assume: bool) -> None:
    """Where a rule proves the oneOf (JSON Schema's reading), anyOf accepts the same values."""
    instances: list[Any] = [None, True, 1, 1.0, 1.5, 0.5, "", "x", "ab", "abc", "ab-x", "acx", [], {}, {"k": "a"}]
    instances += [{"k": "b"}, {"k": "c"}, {"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {"k": "a", "x": 1}]
    changed = oneof_as_anyof(schema) != schema
    assert changed is (rules is not None and not assume), name
    _same_verdicts(schema, instances)


def test_ref_into_a_one_of_is_left_alone() -> None:
    schema = {"oneOf": [{"type": "string"}, {"type": "null"}], "$defs": {"s": {"$ref": "#/oneOf/0"}}}
    assert oneof_as_anyof(schema) is schema


def test_routing_lets_xgrammar_serve_a_proven_one_of() -> None:
    proven = {"type": "object", "properties": {"v": CASES[5][1]}}
    assert xgrammar_gap(proven) is None
    unproven = {"type": "object", "properties": {"v": CASES[6][1]}}
    assert "oneOf" in (xgrammar_gap(unproven) or "")


def test_suite_and_maskbench_verdicts() -> None:
    """Every oneOf the rewrite turns into anyOf, on the shared data: same verdict per instance."""
    base = shared_data_dir()
    if base is None:
        pytest.skip("shared data not found")
    suite: Path = require(base, "json-schema-test-suite", "draft2020-12", "oneOf.json")
    changed = 0
    for group in json.loads(suite.read_text()):
        if oneof_as_anyof(group["schema"]) != group["schema"]:
            changed += 1
            _same_verdicts(group["schema"], [t["data"] for t in group["tests"]])
    assert changed >= 1
    for f in sorted(require(base, "maskbench").glob("*.json")):
        data = json.loads(f.read_text())
        if not any(True for _ in one_ofs(data["schema"])) or oneof_as_anyof(data["schema"]) == data["schema"]:
            continue
        changed += 1
        _same_verdicts(data["schema"], [t["data"] for t in data.get("tests", [])])
    assert changed > 100


def _accepts(matcher: Any, hf_tok: Any, text: str, stop: int) -> bool:
    for t in hf_tok.encode(text, add_special_tokens=False):
        if not matcher.accept_token(int(t)):
            return False
    return bool(matcher.accept_token(stop))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_engines_serve_a_union_told_apart_by_a_closed_object(
    registry: TokenizerRegistry, bpe_id: str, hf_tok: Any, backend: str
) -> None:
    """llguidance refused this oneOf (its own proof does not see closed objects); both serve it now."""
    schema = {
        "type": "object",
        "properties": {
            "v": {
                "oneOf": [
                    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {
                        "type": "object",
                        "properties": {"b": {"type": "integer"}},
                        "required": ["b"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
        "required": ["v"],
    }
    engine = BACKENDS[backend]
    info = registry.info(bpe_id, None)
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), backend=backend)
    compiled = engine.compile(engine.make_compiler(info, 1), spec)
    stop = int(info.stop_token_ids[0])
    for text in ('{"v":{"a":1}}', '{"v":{"b":2}}', '{"v":{}}', '{"v":{"a":1,"b":2}}', '{"v":{"b":"x"}}'):
        valid = OutputChecker().check(spec, text, engine=backend).ok
        accepted = _accepts(engine.new_matcher(compiled), hf_tok, text, stop)
        assert not accepted or valid, (backend, text)  # never a lie
        if text in ('{"v":{"a":1}}', '{"v":{"b":2}}'):
            assert accepted, (backend, text)


@pytest.mark.parametrize(
    "sets",
    [
        [["a"], ["b"]],
        [["a", "b"], ["c"]],
        [["a"], ["a", "b"]],
        [["a", "b"], ["b", "c"], ["c"]],
        [["a"], ["a"]],
        [[], ["a"]],
    ],
)
def test_exclusive_required_keeps_the_language(sets: list[list[str]]) -> None:
    """ "Exactly one of these key sets": every object over the names, and non-objects, get the
    same verdict from the oneOf and its anyOf rewrite (or the rewrite declines)."""
    schema = {"properties": {"a": {}, "b": {}, "c": {}}, "oneOf": [{"required": s, "title": "t"} for s in sets]}
    instances: list[Any] = [None, 1, "a", [], {"x": 1}]
    for mask in range(8):
        instances.append({n: 0 for k, n in enumerate("abc") if mask >> k & 1})
    if oneof_as_anyof(schema) == schema:
        assert sets == [["a"], ["a"]]  # unsatisfiable: left for the engines to refuse
        return
    _same_verdicts(schema, instances)


def test_llguidance_serves_exactly_one_of_these_key_sets(registry: TokenizerRegistry, bpe_id: str, hf_tok: Any) -> None:
    """``oneOf`` of required-only branches beside properties: llguidance enforces the rewrite exactly."""
    props = {n: {"type": "integer"} for n in ("alias", "team", "accession")}
    schema = {
        "type": "object",
        "properties": props,
        "oneOf": [{"required": ["alias", "team"]}, {"required": ["accession"]}],
    }
    auto = BACKENDS["auto"]
    info = registry.info(bpe_id, None)
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    selected = auto.compile(auto.make_compiler(info, 1), spec)
    assert selected.backend == "llguidance"
    stop = int(info.stop_token_ids[0])
    texts = [
        '{"alias":1,"team":2}',
        '{"accession":3}',
        '{"alias":1,"accession":3}',
        '{"alias":1,"team":2,"accession":3}',
    ]
    texts += ['{"alias":1}', "{}", '{"team":2,"accession":3}']
    for text in texts:
        valid = OutputChecker().check(spec, text, engine="llguidance").ok
        assert _accepts(auto.new_matcher(selected), hf_tok, text, stop) is valid, text
