"""The shortest-document bound that refuses schemas which cannot fit in max_tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specmask.orchestrator.output_budget import longest_token_chars, min_json_chars, min_tokens

# (schema, a shortest valid document): the bound must never exceed the document's length.
SHORTEST = [
    ({"type": "string", "minLength": 5}, '"aaaaa"'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 3}, "[0,0,0]"),
    ({"type": "object", "properties": {"ab": {"type": "boolean"}}, "required": ["ab"]}, '{"ab":true}'),
    ({"type": "object", "minProperties": 2}, '{"":0,"a":0}'),
    ({"anyOf": [{"type": "string", "minLength": 50}, {"type": "integer"}]}, "7"),
    ({"allOf": [{"type": "string"}, {"minLength": 3}]}, '"abc"'),
    ({"enum": ["long value", 1.0]}, "1"),
    ({"const": "hi"}, '"hi"'),
    ({"type": ["string", "null"], "minLength": 10}, "null"),
    ({"minLength": 10}, "0"),  # no type: a number passes
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "string", "minLength": 9}}}, '"aaaaaaaaa"'),
]


@pytest.mark.parametrize("schema,doc", SHORTEST)
def test_bound_never_exceeds_a_valid_document(schema: dict, doc: str) -> None:
    jsonschema.validate(json.loads(doc), schema)
    assert min_json_chars(schema) <= len(doc)


def test_bound_is_tight_on_simple_shapes() -> None:
    assert min_json_chars({"type": "string", "minLength": 100000}) == 100002
    assert min_json_chars({"type": "array", "items": {"type": "integer"}, "minItems": 1000}) == 2 + 1000 + 999


def test_tokens_and_vocab() -> None:
    assert min_tokens(json.dumps({"type": "string", "minLength": 98}), 10) == (100, 10)
    assert min_tokens("not json", 10) is None
    assert longest_token_chars(["a", "Ġhello", "=="]) == 6
