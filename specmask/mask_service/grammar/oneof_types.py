"""JSON types a ``oneOf`` can never hold, and what ``contains`` says about an array's length:
two facts the checked-mode relaxation (``schema_relax``) keeps where it drops the keywords.

``oneOf``: a branch *accepts a type whole* when every value of that JSON type passes it, e.g.
``{"items": {...}}`` accepts every non-array, ``{"required": ["a"]}`` every non-object. A
value of a type that two branches accept whole matches at least two branches, so it fails the
``oneOf``. Relaxed to ``anyOf``, the ``oneOf`` would let such values through (``{"oneOf":
[{"items": A}, {"items": B}]}`` as ``anyOf`` admits any string); keeping them out makes the
relaxation tighter and still a superset of the original.

What accepts a type whole (``accepted_whole``), each a sound under-approximation:

* ``true``, ``{}``, keywords that are annotations in the document's draft;
* a keyword that applies to other types only (``minimum`` to numbers, ``items`` to arrays,
  ``required`` to objects...) accepts every value of the rest;
* ``type`` accepts the types it names (``integer`` accepts no type whole: ``1.5`` is a number);
* ``allOf``: what every branch accepts whole; ``anyOf``: what some branch does; a local
  ``$ref``: what its target does (draft 4-7: without its siblings);
* anything else (``not``, ``enum``, ``oneOf``, ``if``, ``format``...): no type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specmask.mask_service.grammar.enum_filter import refs_hide_siblings, validator_keywords
from specmask.mask_service.grammar.schema_rewrite import resolve_ref

TYPES = ("null", "boolean", "object", "array", "string", "number")
# Keywords that assert something only of values of one JSON type.
_ONLY: dict[str, frozenset[str]] = {
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "string": frozenset({"minLength", "maxLength", "pattern"}),
    "array": frozenset(
        {
            "items",
            "prefixItems",
            "additionalItems",
            "contains",
            "minContains",
            "maxContains",
            "minItems",
            "maxItems",
            "uniqueItems",
            "unevaluatedItems",
        }
    ),
    "object": frozenset(
        {
            "properties",
            "patternProperties",
            "additionalProperties",
            "required",
            "minProperties",
            "maxProperties",
            "dependentRequired",
            "dependentSchemas",
            "dependencies",
            "propertyNames",
            "unevaluatedProperties",
        }
    ),
}
_TYPE_OF = {keyword: name for name, keywords in _ONLY.items() for keyword in keywords}
MAX_DEPTH = 32
MAX_VISITS = 4096  # subschemas visited per oneOf (shared references can repeat): past it, no type whole


@dataclass(frozen=True)
class RelaxContext:
    """What the relaxation reads about the whole document."""

    root: Any
    keywords: frozenset[str]  # the validator's keywords in the document's draft (others: annotations)
    refs_ignore_siblings: bool  # draft 4-7
    contains_counts: bool  # minContains/maxContains are keywords (2019-09 on)

    @staticmethod
    def of(root: Any) -> RelaxContext:
        keywords = validator_keywords(root)  # empty (unreadable): every key read as a keyword
        return RelaxContext(
            root=root,
            keywords=keywords,
            refs_ignore_siblings=refs_hide_siblings(root),
            contains_counts="dependentRequired" in keywords,
        )

    def read(self, node: dict[str, Any]) -> bool:
        """Whether the end check reads ``node``'s own keywords (not only its ``$ref``)."""
        return bool(self.keywords) and not ("$ref" in node and self.refs_ignore_siblings)

    def contains_min_items(self, node: dict[str, Any]) -> int:
        """The fewest items ``contains`` (with ``minContains``) leaves an array, 0 if it says nothing."""
        if "contains" not in node or "contains" not in self.keywords or not self.read(node):
            return 0
        count = node.get("minContains", 1) if self.contains_counts else 1
        return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0

    def types_without(self, declared: Any, never: frozenset[str]) -> Any:
        """``type`` for a node whose declared ``type`` is ``declared``, less the types in ``never``;
        None where nothing would be left (left to the engines and the end check)."""
        if declared is None:
            names = list(TYPES)
        elif isinstance(declared, str):
            names = [declared]
        elif isinstance(declared, list) and all(isinstance(t, str) for t in declared):
            names = list(declared)
        else:
            return None
        kept = [t for t in names if ("number" if t == "integer" else t) not in never]
        if not kept or kept == names:
            return None
        return kept[0] if len(kept) == 1 else kept


def types_never_exactly_one(node: dict[str, Any], ctx: RelaxContext) -> frozenset[str]:
    """The JSON types two or more of ``node``'s ``oneOf`` branches accept whole (read as written)."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or "oneOf" not in ctx.keywords or not ctx.read(node):
        return frozenset()
    counts = dict.fromkeys(TYPES, 0)
    budget = [MAX_VISITS]
    for branch in branches:
        for name in accepted_whole(branch, ctx, 0, frozenset(), budget):
            counts[name] += 1
    return frozenset(name for name, n in counts.items() if n >= 2)


def accepted_whole(
    schema: Any, ctx: RelaxContext, depth: int, seen: frozenset[str], budget: list[int]
) -> frozenset[str]:
    """The JSON types every value of which ``schema`` accepts (see the module doc); none once
    ``budget`` (subschemas left to visit, shared by the whole walk) runs out."""
    budget[0] -= 1
    if schema is True:
        return frozenset(TYPES)
    if not isinstance(schema, dict) or depth > MAX_DEPTH or not ctx.keywords or budget[0] < 0:
        return frozenset()
    keys = {k for k in schema if k in ctx.keywords}
    out = set(TYPES)
    if "$ref" in keys:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")) or ref in seen:
            return frozenset()
        target = resolve_ref(ctx.root, ref)
        if target is None:
            return frozenset()
        whole = accepted_whole(target, ctx, depth + 1, seen | {ref}, budget)
        if ctx.refs_ignore_siblings:
            return whole
        out &= whole
        keys.discard("$ref")
    if "type" in keys:
        declared = schema["type"]
        names = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []
        out &= {t for t in names if isinstance(t, str) and t in TYPES}
        keys.discard("type")
    if "allOf" in keys:
        for branch in schema["allOf"] if isinstance(schema["allOf"], list) else [False]:
            out &= accepted_whole(branch, ctx, depth + 1, seen, budget)
        keys.discard("allOf")
    if "anyOf" in keys:
        union: set[str] = set()
        for branch in schema["anyOf"] if isinstance(schema["anyOf"], list) else []:
            union |= accepted_whole(branch, ctx, depth + 1, seen, budget)
        out &= union
        keys.discard("anyOf")
    for key in keys:
        owner = _TYPE_OF.get(key)
        if owner is None:
            return frozenset()  # not, enum, const, oneOf, if, format...: no type whole
        out.discard(owner)
    return frozenset(out)
