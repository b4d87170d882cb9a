"""Structural grammar limits (mask_service.limits): each limit refuses with a message naming it."""

from __future__ import annotations

import json

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.grammar.limits import GrammarLimitError, GrammarLimits, check_limits

SMALL = GrammarLimits(max_schema_bytes=4096, max_properties=10, max_nesting_depth=8, max_enum_values=5)


def _schema(doc: object) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(doc))


def test_within_limits_measures_shape() -> None:
    doc = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"type": "array", "items": {}}}}
    shape = check_limits(_schema(doc), SMALL)
    assert shape is not None
    assert (shape.num_properties, shape.max_enum_values) == (2, 3)
    assert shape.nesting_depth == 4  # root -> properties -> b -> items


@pytest.mark.parametrize(
    ("doc", "limit"),
    [
        ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(11)}}, "max_properties"),
        # properties are counted over every subschema, not per object
        (
            {
                "anyOf": [
                    {"properties": {f"p{i}": {} for i in range(6)}},
                    {"properties": {f"q{i}": {} for i in range(6)}},
                ]
            },
            "max_properties",
        ),
        ({"enum": list(range(6))}, "max_enum_values"),
        ({"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "array"}}}}, None),
    ],
)
def test_each_limit_refuses_with_its_name(doc: object, limit: str | None) -> None:
    if limit is None:  # 4 containers deep: fine at 8
        check_limits(_schema(doc), SMALL)
        return
    with pytest.raises(GrammarLimitError, match=limit):
        check_limits(_schema(doc), SMALL)


def test_depth_and_bytes() -> None:
    deep: dict[str, object] = {"type": "integer"}
    for _ in range(10):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarLimitError, match="max_nesting_depth=8"):
        check_limits(_schema(deep), SMALL)
    with pytest.raises(GrammarLimitError, match="max_schema_bytes=4096"):
        check_limits(GrammarSpec(GrammarKind.REGEX, "a" * 5000), SMALL)


def test_parser_recursion_is_a_depth_refusal_not_a_crash() -> None:
    text = "[" * 200_000 + "]" * 200_000
    with pytest.raises(GrammarLimitError, match="nest"):
        check_limits(GrammarSpec(GrammarKind.JSON_SCHEMA, text), GrammarLimits(max_schema_bytes=10**6))


def test_the_10k_property_schema_is_refused_by_default() -> None:
    doc = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}
    with pytest.raises(GrammarLimitError, match="max_properties=2000"):
        check_limits(_schema(doc), GrammarLimits())


def test_malformed_json_is_left_to_the_engine() -> None:
    assert check_limits(GrammarSpec(GrammarKind.JSON_SCHEMA, "{not json"), SMALL) is None
