"""Refuse JSON-Schema features that xgrammar 0.2.8 accepts but does not enforce.

Checked by hand against xgrammar 0.2.8: it compiles schemas using the keywords
below without error yet produces a grammar that ignores them, i.e. output that
does not validate. A constrained-decoding service must never silently
over-allow, so these are refused up front with INVALID_ARGUMENT:

* ``not``, ``if``/``then``/``else``             (boolean schema logic)
* ``uniqueItems: true``                         (needs whole-array memory)
* ``dependencies``, ``dependentRequired``, ``dependentSchemas``
* ``contains``, ``minContains``, ``maxContains``
* ``multipleOf``                                (not expressible as a regular language in general)
* ``unevaluatedProperties``, ``unevaluatedItems``
* ``$ref`` to anything but a local JSON pointer (``#...``); ``$dynamicRef``, ``$recursiveRef``
* ``pattern`` / ``patternProperties`` keys using lookaround or backreferences
* ``pattern`` together with ``minLength``/``maxLength`` (xgrammar drops the length bounds)
* ``allOf`` with more than one subschema (xgrammar compiles it to "any JSON
  value", warning "Support for allOf with multiple options is still ongoing"),
  and ``allOf`` next to other validation keywords (xgrammar keeps only one
  of the two: ``$ref``/``enum``/``anyOf`` win over ``allOf``, ``allOf`` over
  ``type`` and the rest)
* ``$ref``, ``const``, ``enum``, ``anyOf`` or ``oneOf`` next to other
  validation keywords (xgrammar keeps the first of ``$ref`` > ``const`` >
  ``enum`` > ``anyOf``/``oneOf`` and drops the rest), except a ``type`` that is
  redundant (the enum values / the ``$ref`` target all have it) or that
  ``schema_rewrite`` moves into every ``anyOf``/``oneOf`` branch or uses to
  filter an ``enum``; a ``const`` or ``enum`` with no value of that type, or a
  ``type`` no ``anyOf``/``oneOf`` branch can match, is unsatisfiable
* ``required`` names missing from ``properties`` (xgrammar ignores them) next to
  ``patternProperties`` or ``propertyNames``, or with ``additionalProperties:
  false`` (unsatisfiable); otherwise ``schema_rewrite`` adds them to ``properties``
* a ``format`` xgrammar enforces (email, date, date-time, uuid, ...; see
  ``schema_rewrite.XGRAMMAR_FORMATS``) together with ``pattern``/``minLength``/
  ``maxLength`` (xgrammar drops all three)

What can be enforced after a rewrite (JSON-safe patterns, format email /
json-pointer, minLength/maxLength strings without control characters, schemas
without a type) is done by ``schema_rewrite`` after this check.

Known and *not* refused: xgrammar treats ``oneOf`` whose branches it cannot
prove disjoint as ``anyOf`` (it logs a warning); refusing every ``oneOf``
would refuse a large share of real schemas.

Annotation-only keywords (``title``, ``description``, ``examples``,
``default``, unknown ``format`` values) are not validation and are allowed.
"""

from __future__ import annotations

import re
from typing import Any

from mask_service.errors import GrammarError
from mask_service.schema_rewrite import (
    XGRAMMAR_FORMATS,
    is_stringish,
    is_subtype,
    push_type,
    types_of,
    value_has_type,
)

_REFUSED_KEYWORDS: dict[str, str] = {
    "not": "'not' is not enforced by the grammar engine",
    "if": "'if/then/else' is not enforced by the grammar engine",
    "then": "'if/then/else' is not enforced by the grammar engine",
    "else": "'if/then/else' is not enforced by the grammar engine",
    "dependencies": "'dependencies' is not enforced by the grammar engine",
    "dependentRequired": "'dependentRequired' is not enforced by the grammar engine",
    "dependentSchemas": "'dependentSchemas' is not enforced by the grammar engine",
    "contains": "'contains' is not enforced by the grammar engine",
    "minContains": "'minContains' is not enforced by the grammar engine",
    "maxContains": "'maxContains' is not enforced by the grammar engine",
    "multipleOf": "'multipleOf' is not enforced by the grammar engine",
    "unevaluatedProperties": "'unevaluatedProperties' is not enforced by the grammar engine",
    "unevaluatedItems": "'unevaluatedItems' is not enforced by the grammar engine",
    "$dynamicRef": "'$dynamicRef' is not supported",
    "$recursiveRef": "'$recursiveRef' is not supported",
}
# Keys whose value maps names -> subschemas.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
# Keys whose value is instance data, never a schema.
_DATA_KEYS = ("const", "enum", "default", "examples", "example")
_LOOKAROUND_OR_BACKREF = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<")
# Keywords that constrain an instance (annotations, unknown keywords and $defs do not).
_VALIDATION_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "properties",
        "patternProperties",
        "additionalProperties",
        "unevaluatedProperties",
        "required",
        "minProperties",
        "maxProperties",
        "propertyNames",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "items",
        "prefixItems",
        "additionalItems",
        "unevaluatedItems",
        "contains",
        "minContains",
        "maxContains",
        "minItems",
        "maxItems",
        "uniqueItems",
        "minLength",
        "maxLength",
        "pattern",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
    }
)


def _check_regex(regex: str, where: str) -> None:
    if _LOOKAROUND_OR_BACKREF.search(regex):
        raise GrammarError(f"{where}: regex {regex!r} uses lookaround or backreferences, which cannot be enforced")


_WINNERS = ("$ref", "const", "enum", "anyOf", "oneOf")  # the first one present is all xgrammar enforces


def _check_winner(schema: dict[str, Any], path: str, root: Any) -> None:
    winner = next((k for k in _WINNERS if k in schema), None)
    if winner is None:
        return
    siblings = set(_VALIDATION_KEYWORDS & schema.keys()) - {winner, "type"}
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in XGRAMMAR_FORMATS:
        siblings.add("format")
    if siblings:
        raise GrammarError(
            f"unsupported JSON Schema keyword at {path}/{winner}: '{winner}' next to {', '.join(sorted(siblings))} is "
            f"not enforced by the grammar engine (it keeps only '{winner}'); move them into the subschema"
        )
    if "type" not in schema:
        return
    t = schema["type"]
    if winner in ("const", "enum"):
        values = [schema["const"]] if winner == "const" else schema["enum"]
        if isinstance(values, list) and not any(value_has_type(v, t) for v in values):
            raise GrammarError(
                f"unsupported at {path}/{winner}: no '{winner}' value has the 'type' next to it (unsatisfiable schema)"
            )
    elif winner == "$ref":
        if not is_subtype(schema, t, root):
            raise GrammarError(
                f"unsupported JSON Schema keyword at {path}/$ref: 'type' next to '$ref' is not enforced by the grammar "
                "engine (it keeps only '$ref'); move the type into the referenced schema"
            )
    elif isinstance(schema[winner], list):
        push_type(schema[winner], t, root, f"{path}/{winner}")  # raises where the type cannot be moved in


def _check_required(schema: dict[str, Any], path: str) -> None:
    required = schema.get("required")
    if not isinstance(required, list) or not types_of(schema.get("type")) & {"object", None}:
        return
    props = schema.get("properties")
    missing = [r for r in required if isinstance(r, str) and not (isinstance(props, dict) and r in props)]
    if not missing:
        return
    if schema.get("additionalProperties") is False:
        raise GrammarError(
            f"unsupported at {path}/required: {missing[0]!r} is required but not in 'properties' and "
            "additionalProperties is false (unsatisfiable schema)"
        )
    for key in ("patternProperties", "propertyNames"):
        if key in schema:
            raise GrammarError(
                f"unsupported at {path}/required: {missing[0]!r} is required but not in 'properties', which is not "
                f"enforced by the grammar engine next to '{key}'; list it in 'properties'"
            )


def _check_node(schema: dict[str, Any], path: str, root: Any = None) -> None:
    """Refusals that depend on a schema's keywords together rather than one keyword."""
    _check_winner(schema, path, root)
    _check_required(schema, path)
    all_of = schema.get("allOf")
    if isinstance(all_of, list):
        if len(all_of) > 1:
            raise GrammarError(
                f"unsupported JSON Schema keyword at {path}/allOf: 'allOf' with {len(all_of)} subschemas is not "
                "enforced by the grammar engine (it would allow any JSON value); merge them into one schema"
            )
        siblings = sorted(_VALIDATION_KEYWORDS & schema.keys())
        if siblings:
            raise GrammarError(
                f"unsupported JSON Schema keyword at {path}/allOf: 'allOf' next to {', '.join(siblings)} is not "
                "enforced by the grammar engine (it enforces one or the other, not both); move them into the subschema"
            )
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in XGRAMMAR_FORMATS and is_stringish(schema):
        dropped = [k for k in ("pattern", "minLength", "maxLength") if k in schema]
        if dropped:
            raise GrammarError(
                f"unsupported at {path}: 'format: {fmt}' combined with {'/'.join(dropped)} is not enforced "
                "by the grammar engine (it drops them for the format)"
            )


def check_schema(schema: Any, path: str = "#", root: Any = None) -> None:
    """Raise GrammarError at the first refused feature; return None if the schema is acceptable."""
    if root is None:
        root = schema
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            check_schema(sub, f"{path}/{i}", root)
        return
    if not isinstance(schema, dict):
        return
    _check_node(schema, path, root)
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in _DATA_KEYS:
            continue
        if key in _REFUSED_KEYWORDS:
            raise GrammarError(f"unsupported JSON Schema keyword at {where}: {_REFUSED_KEYWORDS[key]}")
        if key == "uniqueItems" and value is True:
            raise GrammarError(f"unsupported JSON Schema keyword at {where}: 'uniqueItems: true' is not enforced")
        if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
            raise GrammarError(
                f"unsupported $ref at {where}: only local references ('#/...') are resolved, got {value!r}"
            )
        if key == "pattern" and isinstance(value, str):
            _check_regex(value, where)
            if "minLength" in schema or "maxLength" in schema:
                raise GrammarError(
                    f"unsupported at {path}: 'pattern' combined with minLength/maxLength is not enforced"
                )
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                if key == "patternProperties":
                    _check_regex(name, f"{where}/{name}")
                check_schema(sub, f"{where}/{name}", root)
            continue
        if isinstance(value, (dict, list)):
            check_schema(value, where, root)
