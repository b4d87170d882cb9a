"""The exact conjunction of two JSON Schemas as one schema, where one exists keyword by keyword.

``merge(a, b, ctx)`` returns a schema whose instances are exactly those valid against both
``a`` and ``b`` (``{"allOf": [a, b]}``), or None where this module cannot prove that. It is
the building block of the exact rewrites (``allof_merge``, ``anyof_distribute``,
``dependencies``), which exist because xgrammar enforces none of ``allOf`` with several
branches, keywords beside ``anyOf``/``oneOf``, or ``dependentRequired``/``dependentSchemas``.

Per keyword, why the merged value is the conjunction:

* a keyword on one side only: copied (it constrains the conjunction the same way);
* ``type``: the intersection of the two type sets (``integer`` inside ``number``);
* lower bounds (``minimum``, ``exclusiveMinimum``, ``minLength``, ``minItems``,
  ``minProperties``): the larger; upper bounds the smaller (both are ``x >= a and x >= b``);
* ``required``: the union; ``uniqueItems``: either; ``allOf``: the two lists joined;
* ``multipleOf``: the least common multiple of two positive integers;
* ``items``, ``propertyNames``, ``additionalProperties`` (both schemas): merged recursively;
* ``properties`` and ``additionalProperties`` together: a key ``k`` is checked by each
  side's ``properties[k]`` if it declares ``k``, else by its ``additionalProperties``, so
  the merged ``properties[k]`` is the merge of the two (declared or additional) schemas and
  the merged ``additionalProperties`` the merge of both sides'. A side whose additional
  schema is ``false`` forbids the other side's extra names: they are left out, and the
  merged ``additionalProperties: false`` forbids them.
* equal values (``pattern``, ``format``, ``const``...) are kept once.

Anything else on both sides (two different patterns, two ``anyOf``, ``not``, ``if``,
tuple ``items``, ``patternProperties``...) returns None: no merge is better than a wrong one.

Strict mode (``GrammarSpec.strict``, the default) closes an object schema that lists
``properties``/``patternProperties`` and says nothing about ``additionalProperties``
(xgrammar's ``strict_mode``; the end check's ``output_check.strict_schema``). The merge
reads each side that way (its additional schema is ``false``), so the result is never wider
than that reading of the original; two sides that both list properties and leave it open
are not merged in strict mode (llguidance's reading leaves such an intersection open, and
the xgrammar reading of it is usually empty).

``$ref`` on a side is replaced by a copy of its target (local JSON pointers only; the
caller has checked the document uses no ``$id`` or anchors, so every reference inside the
copy still resolves to the same place).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any

from specmask.mask_service.grammar.schema_rewrite import resolve_ref, types_of

# Keywords that constrain an instance. Every other key is an annotation or unknown (ignored
# by validators), except the few in _CARRIED that locate or identify subschemas.
VALIDATION_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "$ref",
        "anyOf",
        "oneOf",
        "allOf",
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
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "$dynamicRef",
        "$recursiveRef",
    }
)
# Keys a branch may not carry into a merge: references could point into them, or they change
# how references resolve.
_CARRIED = frozenset({"$defs", "definitions", "$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor"})
# Nested merges (properties of properties, through references) before a merge gives up.
MAX_DEPTH = 24
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_SAME = ("pattern", "format", "const", "enum", "contentEncoding", "contentMediaType")
_JSON_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")


@dataclass(frozen=True)
class MergeContext:
    """What a merge needs to know about the whole document."""

    root: Any  # the schema document ($ref targets)
    strict: bool  # GrammarSpec.strict: objects that list properties are closed
    refs_ignore_siblings: bool  # draft 4-7: keywords beside $ref are ignored
    boolean_schemas: bool = True  # false as a subschema is valid (not in a declared draft 3/4)


def lists_properties(node: dict[str, Any]) -> bool:
    return "properties" in node or "patternProperties" in node


def effective_additional(node: dict[str, Any], strict: bool) -> Any:
    """The schema ``node`` applies to undeclared keys: its additionalProperties, ``False``
    for an object strict mode closes, else None (any value)."""
    if "additionalProperties" in node:
        return node["additionalProperties"]
    if strict and lists_properties(node) and "unevaluatedProperties" not in node:
        return False
    return None


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def type_meet(a: Any, b: Any) -> list[str] | None:
    ta, tb = types_of(a), types_of(b)
    out = []
    for name in _JSON_TYPES:
        in_a = name in ta or (name == "integer" and "number" in ta)
        in_b = name in tb or (name == "integer" and "number" in tb)
        if in_a and in_b:
            out.append(name)
    if "number" in out and "integer" in out:
        out.remove("integer")
    return out or None


def inline(node: Any, ctx: MergeContext, depth: int = 0) -> Any:
    """``node`` with a top-level local ``$ref`` replaced by a copy of its target (chains
    followed), or None where that is not exact (remote reference, missing target, cycle,
    keywords beside the reference in a draft that ignores them)."""
    if node is True:
        return {}
    if not isinstance(node, dict):
        return node  # False stays False: the callers drop or refuse it
    ref = node.get("$ref")
    if ref is None:
        return node
    if depth > 16 or not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    target = resolve_ref(ctx.root, ref)
    if target is True:
        target = {}
    if not isinstance(target, dict) or _CARRIED & target.keys() - {"$defs", "definitions"}:
        return None
    siblings = {k: v for k, v in node.items() if k != "$ref" and k in VALIDATION_KEYWORDS}
    resolved = inline({k: v for k, v in target.items() if k not in ("$defs", "definitions")}, ctx, depth + 1)
    if resolved is None:
        return None
    if not siblings or ctx.refs_ignore_siblings:
        return copy.deepcopy(resolved)
    return merge(resolved, siblings, ctx)


def merge(a: Any, b: Any, ctx: MergeContext, b_strict: bool | None = None, depth: int = 0) -> dict[str, Any] | None:
    """The exact conjunction of ``a`` and ``b`` as one schema (``a``'s annotations kept), or None.

    ``b_strict``: whether strict mode's reading applies to ``b`` (default: ``ctx.strict``);
    False for a schema the strict reading never closes, such as a ``dependentSchemas`` value
    (an assertion: the end check reads it as written)."""
    b_strict = ctx.strict if b_strict is None else b_strict
    if depth > MAX_DEPTH:
        return None  # recursive references merged into each other: no end to unfold
    a, b = inline(a, ctx), inline(b, ctx)
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return None
    if _CARRIED & b.keys():
        return None
    if (
        ctx.strict
        and b_strict
        and lists_properties(a)
        and lists_properties(b)
        and ("additionalProperties" not in a or "additionalProperties" not in b)
    ):
        return None
    for group in _GROUPS:
        if group & a.keys() and group & b.keys() and not (group is _ARRAY_PART and _plain_items(a) and _plain_items(b)):
            return None
    if any(isinstance(s.get(k), bool) for s in (a, b) for k in ("exclusiveMinimum", "exclusiveMaximum")):
        return None  # draft-04 boolean bounds read together with minimum/maximum of their own side
    out = {k: v for k, v in a.items() if k != "$ref"}
    for key, value in b.items():
        if key not in VALIDATION_KEYWORDS or key in _OBJECT_PART:
            continue
        if key not in out:
            out[key] = copy.deepcopy(value)
            continue
        merged = _merge_keyword(key, out[key], value, ctx, b_strict, depth)
        if merged is _FAIL:
            return None
        out[key] = merged
    if any(k in a or k in b for k in _OBJECT_PART):
        props = _merge_object(a, b, ctx, b_strict, depth)
        if props is None:
            return None
        for key in _OBJECT_PART:
            out.pop(key, None)
        out.update(props)
    return out


_FAIL = object()
# Keywords read together within one schema object: two sides' members cannot be mixed
# (``prefixItems`` of one and ``items`` of the other would exempt the prefix from ``items``).
_ARRAY_PART = frozenset({"items", "prefixItems", "additionalItems"})
_GROUPS = (
    _ARRAY_PART,
    frozenset({"if", "then", "else"}),
    frozenset({"contains", "minContains", "maxContains"}),
    frozenset({"not"}),
    frozenset({"anyOf"}),
    frozenset({"oneOf"}),
    frozenset({"dependencies"}),
    frozenset({"dependentSchemas"}),
)


def _plain_items(node: dict[str, Any]) -> bool:
    """Whether the node's only array-item keyword is a schema-valued ``items``."""
    return _ARRAY_PART & node.keys() == {"items"} and not isinstance(node["items"], list)


_OBJECT_PART = ("properties", "additionalProperties", "patternProperties")


def _merge_keyword(key: str, x: Any, y: Any, ctx: MergeContext, b_strict: bool, depth: int) -> Any:
    if x == y and type(x) is type(y) and key not in ("allOf",):
        return x
    if key == "type":
        meet = type_meet(x, y)
        return _FAIL if meet is None else (meet[0] if len(meet) == 1 else meet)
    if key in _LOWER or key in _UPPER:
        if not (_number(x) and _number(y)):
            return _FAIL  # draft-04 boolean exclusive bounds
        return max(x, y) if key in _LOWER else min(x, y)
    if key == "required" and isinstance(x, list) and isinstance(y, list):
        return [*x, *(r for r in y if r not in x)]
    if key == "uniqueItems" and isinstance(x, bool) and isinstance(y, bool):
        return x or y
    if key == "allOf" and isinstance(x, list) and isinstance(y, list):
        return [*x, *copy.deepcopy(y)]
    if key == "multipleOf" and isinstance(x, int) and isinstance(y, int) and x > 0 and y > 0:
        return x * y // math.gcd(x, y)
    if key in ("items", "propertyNames", "additionalItems") and not isinstance(x, list) and not isinstance(y, list):
        if x is False or y is False:
            return False
        merged = merge(x, y, ctx, b_strict, depth + 1)
        return _FAIL if merged is None else merged
    if key == "dependentRequired" and isinstance(x, dict) and isinstance(y, dict):
        out = {k: list(v) for k, v in x.items()}
        for k, v in y.items():
            if not (isinstance(v, list) and isinstance(out.get(k, []), list)):
                return _FAIL
            out[k] = [*out.get(k, []), *(n for n in v if n not in out.get(k, []))]
        return out
    return _FAIL  # different patterns/formats/values, two anyOf/oneOf/not/if, tuples...


def _merge_object(
    a: dict[str, Any], b: dict[str, Any], ctx: MergeContext, b_strict: bool, depth: int
) -> dict[str, Any] | None:
    """The merged properties/additionalProperties/patternProperties (see the module doc)."""
    if "patternProperties" in a or "patternProperties" in b:
        # A key may match a pattern on one side and be declared on the other; kept to one side.
        if any(k in other for k in _OBJECT_PART for other in (a, b) if "patternProperties" not in other):
            return None
        if "patternProperties" in a and "patternProperties" in b:
            return None
        side = a if "patternProperties" in a else b
        return {k: copy.deepcopy(side[k]) for k in _OBJECT_PART if k in side}
    pa = a.get("properties", {})
    pb = b.get("properties", {})
    if not (isinstance(pa, dict) and isinstance(pb, dict)):
        return None
    extra_a, extra_b = effective_additional(a, ctx.strict), effective_additional(b, b_strict)
    for side, other, extra in ((a, b, extra_a), (b, a, extra_b)):
        if extra is False and "additionalProperties" not in side and not _names_declared(other, side):
            # Strict mode closes ``side`` but declares its own required names; a name only the
            # other side requires is one it forbids (xgrammar's reading), which llguidance's
            # reading of the intersection leaves open: the readings differ, so no merge.
            return None
    out_props: dict[str, Any] = {}
    for name in [*pa, *(n for n in pb if n not in pa)]:
        left = pa.get(name, extra_a)
        right = pb.get(name, extra_b)
        value = _conjoin(left, right, ctx, b_strict, depth)
        if value is _FAIL:
            return None
        if value is False and (name not in pa or name not in pb):
            continue  # an extra name one side forbids: the merged additionalProperties false forbids it
        out_props[name] = value
    out: dict[str, Any] = {}
    if "properties" in a or "properties" in b:
        out["properties"] = out_props
    extra = _conjoin(extra_a, extra_b, ctx, b_strict, depth)
    if extra is _FAIL:
        return None
    explicit_false = a.get("additionalProperties") is False or b.get("additionalProperties") is False
    if extra is not None and not (extra is False and not explicit_false):
        out["additionalProperties"] = extra
    # else: closed by strict mode alone, and left to it: it declares the required names a
    # closed object lacks (output_check.strict_schema), where an explicit false would not.
    return out


def _names_declared(other: dict[str, Any], side: dict[str, Any]) -> bool:
    """Whether every name ``other`` requires is declared or required by ``side``."""
    required = other.get("required", [])
    props = side.get("properties", {})
    own = side.get("required", [])
    known = {*(props if isinstance(props, dict) else {}), *(own if isinstance(own, list) else [])}
    return all(r in known for r in required) if isinstance(required, list) else False


def _conjoin(x: Any, y: Any, ctx: MergeContext, b_strict: bool, depth: int) -> Any:
    """Conjunction of two subschemas where None means "no constraint"."""
    x_any, y_any = x is None or x is True or x == {}, y is None or y is True or y == {}
    if x_any and y_any:
        return None if x is None and y is None else {}
    if x_any:
        return copy.deepcopy(y)
    if y_any:
        return copy.deepcopy(x)
    if x is False or y is False:
        return False
    merged = merge(x, y, ctx, b_strict, depth + 1)
    return _FAIL if merged is None else merged


def size(schema: Any) -> int:
    """Length of the compact JSON text (what the size bounds of the rewrites count)."""
    return len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
