"""JSON-Schema refusals and the strict-mode rewrite for the llguidance backend.

llguidance 1.9.1 already refuses what it does not implement (checked by hand and
by ``python -m bench.coverage``): ``not``, ``if``/``then``/``else``,
``uniqueItems``, ``contains``/``minContains``/``maxContains``,
``dependencies``/``dependentRequired``/``dependentSchemas``,
``unevaluatedProperties``/``unevaluatedItems``, ``propertyNames``,
``$dynamicRef``/``$recursiveRef``, non-local ``$ref``, unknown ``format``
values, lookaround/backreferences in patterns, and ``oneOf`` whose branches it
cannot prove disjoint. What it enforces beyond xgrammar: sibling keywords beside
``anyOf``/``oneOf``/``allOf``/``$ref`` (intersection), multi-branch ``allOf``,
``multipleOf``, ``pattern`` with ``minLength``/``maxLength``, ``format`` with
``pattern``/lengths, ``minProperties``/``maxProperties``.

This module adds the refusals found by instance checks (JSON-Schema-Test-Suite
and maskbench, see docs/grammars.md, "What each engine enforces"): each entry below names what
llguidance accepts without enforcing.

Unknown keywords (``nullable``, ``discriminator``, ``contentEncoding``, ...)
are annotations in JSON Schema and are ignored by every validator; they stay
allowed.
"""

from __future__ import annotations

from typing import Any

# Formats JSON Schema defines (draft 2020-12, 7.3); any other value is an annotation.
STANDARD_FORMATS = frozenset(
    {
        "date-time",
        "date",
        "time",
        "duration",
        "email",
        "idn-email",
        "hostname",
        "idn-hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "iri",
        "iri-reference",
        "uuid",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
        "regex",
    }
)

# Keys whose value maps names -> subschemas.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
# Keys whose value is instance data, never a schema.
_DATA_KEYS = ("const", "enum", "default", "examples", "example")
# Keywords that make a node an object schema for strict mode.
_OBJECT_KEYS = ("properties", "patternProperties", "required", "minProperties", "maxProperties")
# Keywords that already say what undeclared properties may be. Not ``patternProperties``:
# it says what keys matching a pattern may hold; other keys are still the strict default's
# (closed, as xgrammar's strict_mode reads it), and additionalProperties: false beside it
# leaves the pattern-matching keys allowed.
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties")
_COMBINATORS = ("allOf", "anyOf", "oneOf")


def _refuse_node(node: dict[str, Any], path: str) -> None:
    """Per-node refusals (filled in from measured lies; see module doc)."""
    del node, path


def check_llguidance_schema(schema: Any, path: str = "#") -> None:
    """Raise GrammarError at the first construct llguidance would accept without enforcing it."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            check_llguidance_schema(sub, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    _refuse_node(schema, path)
    for key, value in schema.items():
        if key in _DATA_KEYS:
            continue
        where = f"{path}/{key}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_llguidance_schema(sub, f"{where}/{name}")
        elif isinstance(value, (dict, list)):
            check_llguidance_schema(value, where)


def _is_object_schema(node: dict[str, Any]) -> bool:
    t = node.get("type")
    is_object = t == "object" or (isinstance(t, list) and "object" in t)
    return is_object or any(k in node for k in _OBJECT_KEYS)


def _intersects(node: dict[str, Any]) -> bool:
    """Whether the node's object keywords are combined with other subschemas (an intersection)."""
    if "allOf" in node:
        return True
    others = {k for k in node if k not in ("$defs", "definitions", "title", "description", "default", "examples")}
    if "$ref" in node and len(others) > 1:
        return True
    return any(k in node for k in ("anyOf", "oneOf")) and _is_object_schema(node)


def _intersection_refs(schema: Any, out: set[str]) -> None:
    """$ref targets used inside an intersection (their object must stay open to the other branches)."""
    if isinstance(schema, list):
        for sub in schema:
            _intersection_refs(sub, out)
        return
    if not isinstance(schema, dict):
        return
    if _intersects(schema):
        if isinstance(schema.get("$ref"), str):
            out.add(schema["$ref"])
        for comb in _COMBINATORS:
            for branch in schema.get(comb, []) if isinstance(schema.get(comb), list) else []:
                if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
                    out.add(branch["$ref"])
    for key, value in schema.items():
        if key in _DATA_KEYS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for sub in value.values():
                _intersection_refs(sub, out)
        elif isinstance(value, (dict, list)):
            _intersection_refs(value, out)


def strict_schema(schema: Any) -> Any:
    """``additionalProperties: false`` on object schemas that leave it open (xgrammar's strict_mode),
    and non-standard ``format`` values (annotations) removed.

    Not added where the object is one side of an intersection (``allOf``
    branches, a node whose properties sit beside ``anyOf``/``oneOf``/``$ref``,
    and ``$ref`` targets used there): there, JSON Schema's
    ``additionalProperties`` would also forbid the other side's properties. So
    strict mode is a tightening where it is safe and a no-op elsewhere; it never
    loosens the schema.
    """
    shared: set[str] = set()
    _intersection_refs(schema, shared)
    return _strict(schema, "#", loose=False, shared=shared)


def _strict(node: Any, path: str, *, loose: bool, shared: set[str]) -> Any:
    if isinstance(node, list):
        return [_strict(sub, f"{path}/{i}", loose=False, shared=shared) for i, sub in enumerate(node)]
    if not isinstance(node, dict):
        return node
    loose = loose or path in shared
    inter = _intersects(node)
    out: dict[str, Any] = {}
    for key, value in node.items():
        where = f"{path}/{key}"
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {
                name: _strict(sub, f"{where}/{_pointer_escape(name)}", loose=False, shared=shared)
                for name, sub in value.items()
            }
        elif key in _COMBINATORS and isinstance(value, list):
            # A union inside one side of an intersection (an allOf branch holding an anyOf) is
            # part of that side: its branches stay open to the other sides' properties too.
            branch_loose = key == "allOf" or inter or loose
            out[key] = [_strict(sub, f"{where}/{i}", loose=branch_loose, shared=shared) for i, sub in enumerate(value)]
        elif isinstance(value, (dict, list)):
            out[key] = _strict(value, where, loose=False, shared=shared)
        else:
            out[key] = value
    if isinstance(out.get("format"), str) and out["format"] not in STANDARD_FORMATS:
        # Not a JSON-Schema format: an annotation every validator ignores, which
        # llguidance would refuse as "Unknown format" ("textarea", "datetime", ...).
        del out["format"]
    props = p if isinstance(p := node.get("properties"), dict) else {}
    required = [
        *(req if isinstance(req := node.get("required"), list) else []),
        *(n for key in ("dependentRequired", "dependencies") for n in _dependency_names(node.get(key))),
    ]
    # A required name with no declared schema must stay allowed as an extra key.
    undeclared = any(isinstance(r, str) and r not in props for r in required)
    if not (loose or inter or undeclared) and _is_object_schema(node) and not any(k in node for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _dependency_names(value: Any) -> list[str]:
    """Names a dependentRequired (or list-valued dependencies) map can require: like required
    names, they must stay allowed (output_check.dependency_names)."""
    if not isinstance(value, dict):
        return []
    return [n for names in value.values() if isinstance(names, list) for n in names if isinstance(n, str)]


def _pointer_escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
