"""Checked mode's end check is never stricter than the schema, never looser.

The valid maskbench instances ``bench.coverage --checked`` reported as "end check rejects valid"
were rejected by the bench, not by the server: the bench ran the end check with xgrammar's strict
reading (``OutputChecker.check`` without an engine), while the relaxations of these schemas are
masked by llguidance, whose strict rewrite leaves an intersection's sides open (an ``allOf``
branch, properties beside a ``oneOf``), and the orchestrator checks with the reading of the
engine that masked the output (``GrammarReport.backend``). Each instance is checked here as the
orchestrator checks it, and an invalid neighbour of each must still fail.

One real over-restriction of the checker: strict defaults were pushed into ``not`` (and the other
assertion-only keywords), so inside a double negation they refused documents the schema allows
(``output_check.without_assertions``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.coverage import Case, Checker, Tally, run_case
from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.orchestrator.output_check import OutputChecker
from tests.fixtures.shared_data import require

# Github_easy---o90953 (descriptions and notes dropped): oneOf over allOf-composed objects.
JSONRPC = {
    "$schema": "http://json-schema.org/draft-04/schema#",
    "oneOf": [
        {"$ref": "#/definitions/success"},
        {"$ref": "#/definitions/error"},
        {"type": "array", "items": {"oneOf": [{"$ref": "#/definitions/success"}, {"$ref": "#/definitions/error"}]}},
    ],
    "definitions": {
        "common": {
            "required": ["id", "jsonrpc"],
            "not": {"required": ["result", "error"]},
            "type": "object",
            "properties": {"id": {"type": ["string", "integer", "null"]}, "jsonrpc": {"enum": ["2.0"]}},
        },
        "success": {"allOf": [{"$ref": "#/definitions/common"}, {"required": ["result"]}]},
        "error": {
            "allOf": [
                {"$ref": "#/definitions/common"},
                {
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["code", "message"],
                            "properties": {"code": {"type": "integer"}, "message": {"type": "string"}, "data": {}},
                        }
                    },
                },
            ]
        },
    },
}
# Github_easy---o7501 (descriptions and titles dropped): a property whose value is an allOf of two objects.
MERGE = {
    "dependencies": {"mandatory": ["enum"]},
    "properties": {
        "allOf": {
            "allOf": [
                {"properties": {"key1": {"type": "string"}}, "type": "object"},
                {"properties": {"key2": {"type": "string"}}, "type": "object"},
            ],
            "type": "object",
        },
        "anyOf": {
            "anyOf": [
                {"properties": {"type": {"enum": ["Type1"]}}, "type": "object"},
                {"properties": {"type": {"enum": ["Type2"]}}, "type": "object"},
            ],
            "type": "object",
        },
        "enum": {"enum": ["choice1", "choice2", "choice3"]},
        "mandatory": {"type": "string"},
    },
    "required": ["mandatory"],
}

# (schema, the valid instance the bench reported rejected, invalid neighbours that must fail)
CASES = [
    (
        JSONRPC,
        '{"jsonrpc":"2.0","id":1,"result":"Hello, World!"}',
        [
            '{"jsonrpc":"2.0","id":1,"result":1,"error":{"code":1,"message":"m"}}',  # not: both
            '{"jsonrpc":"1.0","id":1,"result":"x"}',
            '{"jsonrpc":"2.0","id":1.5,"result":"x"}',
        ],
    ),
    (
        MERGE,
        '{"allOf":{"key1":"value1","key2":"value2"},"anyOf":{"type":"Type1"},"enum":"choice1",'
        '"mandatory":"required_value"}',
        [
            '{"allOf":{"key1":"value1","key2":2},"enum":"choice1","mandatory":"m"}',
            '{"mandatory":"m"}',  # dependencies: mandatory needs enum
            '{"allOf":{"key1":"v"},"enum":"choice1","mandatory":"m","extra":1}',  # strict: root closed
        ],
    ),
]


# Schemas with valid instances bench.coverage --checked reported rejected (the Github ones by the
# bench's engine-less check, the Synthesized ones by strict defaults inside negations).
REPORTED = [
    "Github_easy---o7501",
    "Github_easy---o89710",
    "Github_easy---o90953",
    "Github_medium---o17127",
    "Github_medium---o25692",
    "Github_medium---o25763",
    "Github_medium---o35868",
    "Github_medium---o65916",
    "Github_medium---o65917",
    "Github_medium---o65945",
    "Synthesized---draft2019_09_nonvalid_additionalProperties_id10_subschema1_not_2",
    "Synthesized---draft2019_09_nonvalid_maxProperties_id1_subschema1_not_2",
]


@pytest.fixture(scope="module")
def checker() -> OutputChecker:
    return OutputChecker()


# Synthesized---draft2019_09_nonvalid_*_not_2: the valid instance of each, a double negation around
# an object schema. Strict defaults pushed into the negations closed the inner object, so the
# strict validator refused the instance the schema (and the relaxation's grammar) allow.
DOUBLE_NOT = [
    (
        {
            "allOf": [
                {"enum": [{"bar": 2, "foo": 1, "quux": True}]},
                {"not": {"not": {"properties": {"bar": {}, "foo": {}}}}},
            ]
        },
        '{"bar":2,"foo":1,"quux":true}',
        ['{"bar":2,"foo":1}', '{"bar":2,"foo":1,"quux":true,"x":1}'],
    ),
    (
        {"allOf": [{"enum": [{"foo": 1}]}, {"not": {"not": {"maxProperties": 2}}}]},
        '{"foo":1}',
        ['{"foo":1,"bar":2,"baz":3}'],
    ),
    (
        {"allOf": [{"enum": [{"foo": 123}]}, {"not": {"not": {"type": ["array", "object"]}}}]},
        '{"foo":123}',
        ['{"foo":123,"bar":456}'],
    ),
    # Not looser: a single negation is still checked in full (the schema as written).
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "not": {"properties": {"a": {"const": 1}}}},
        '{"a":2}',
        ['{"a":1}', '{"a":2,"b":3}'],
    ),
    # A property named like an assertion keyword is data, not dropped: strict still closes around it.
    (
        {"type": "object", "properties": {"not": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
        '{"not":{"x":1}}',
        ['{"not":{"x":1,"y":2}}', '{"not":{"x":"1"}}'],
    ),
]


@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
@pytest.mark.parametrize(("schema", "valid", "invalid"), DOUBLE_NOT)
def test_strict_mode_stays_out_of_assertions(
    checker: OutputChecker, engine: str, schema: dict, valid: str, invalid: list[str]
) -> None:
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), checked=True)
    verdict = checker.check(spec, valid, engine)
    assert verdict.ok, verdict.reason
    for text in invalid:
        assert not checker.check(spec, text, engine).ok, text


@pytest.mark.parametrize(("schema", "valid", "invalid"), CASES)
def test_end_check_reads_strict_as_the_masking_engine_does(
    checker: OutputChecker, schema: dict, valid: str, invalid: list[str]
) -> None:
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), checked=True)
    verdict = checker.check(spec, valid, "llguidance")
    assert verdict.ok, verdict.reason
    for text in invalid:
        assert not checker.check(spec, text, "llguidance").ok, text


def _served_exactly(res: dict) -> bool:
    """A schema exact_rewrites made exact (its dependencies expanded, its allOf merged) is no
    longer a checked-mode case: then it must accept its valid instances and no invalid one."""
    if res["accepted"] != 1:
        return False
    assert res["invalid_accepted"] == 0 and res["crashes"] == 0, res
    assert res["valid_accepted"] >= 1, res
    return True


@pytest.mark.parametrize(("schema", "valid", "invalid"), CASES)
def test_coverage_bench_checks_with_the_selected_engine(
    bpe_dir: Path, schema: dict, valid: str, invalid: list[str]
) -> None:
    """The checked relaxation is llguidance's, and the bench's end check now passes the engine."""
    tally = Tally()
    tests = [(json.loads(valid), True)] + [(json.loads(t), False) for t in invalid]
    run_case(Checker(str(bpe_dir), "auto", strict=True, checked=True), Case("c", "c", schema, tests), tally, False)
    res = tally.result(checked=True)
    if _served_exactly(res):
        return
    assert res["checked_accepted"] == 1 and res["accepted_by"] == {"checked:llguidance": 1}, res
    assert res["checked_valid_accepted"] == 1 and res["checked_end_check_rejects_valid"] == 0, res
    assert res["checked_lies"] == 0, tally.lies


@pytest.mark.shared_data
@pytest.mark.parametrize("name", REPORTED)
def test_maskbench_instances_the_bench_reported_rejected(shared_data: Path, bpe_dir: Path, name: str) -> None:
    """Every labelled instance of each schema, as ``bench.coverage --checked`` runs it."""
    doc = json.loads(require(shared_data, "maskbench", f"{name}.json").read_text())
    tally = Tally()
    case = Case("maskbench", name, doc["schema"], [(t["data"], bool(t["valid"])) for t in doc["tests"]])
    run_case(Checker(str(bpe_dir), "auto", strict=True, checked=True), case, tally, False)
    res = tally.result(checked=True)
    if _served_exactly(res):
        return
    assert res["checked_accepted"] == 1 and res["crashes"] == 0, res
    assert res["checked_valid_accepted"] >= 1 and res["checked_end_check_rejects_valid"] == 0, res
    assert res["checked_lies"] == 0, tally.lies
