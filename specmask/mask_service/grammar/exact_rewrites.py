"""Rewrites that keep a JSON Schema's language exactly and turn it into one the engines enforce.

Run by the engine selection (``backends.SelectingBackend``) on every JSON schema before any
engine sees it; the end check still reads the caller's original schema. Each rule is its own
module, with when it applies and why its result is the same language:

* ``allOf`` (``allof_merge``): branches merged into the node;
* ``dependencies`` (``dependencies``): ``dependentRequired``/``dependentSchemas``/
  ``dependencies`` expanded into an ``anyOf`` of object shapes;
* ``anyOf`` (``anyof_distribute``): keywords beside ``anyOf``/``oneOf`` pushed into the branches;
* ``enum`` (``enum_filter``): scalar ``enum``/``const`` values filtered by the keywords beside them;
* ``integers`` (``integer_enum``): a bounded number whose every instance is an integer, with
  ``not``/``if``/``oneOf``/``multipleOf`` in or below it, as the ``enum`` of the integers that pass it.

The first three rest on ``schema_merge.merge``. Rules apply bottom-up (a node's subschemas first), each
node's rules until none changes it (bounded).

What the rewrite never touches, because moving subschemas would change what a reference
means or what an annotation-dependent keyword sees: documents with ``$id``/anchors below the
root, remote or dynamic references, ``unevaluatedProperties``/``unevaluatedItems``; and, at a
node, any rewrite when a ``$ref`` elsewhere points inside the parts of it that would change
(anything but its ``$defs``/``definitions``).

A rule that fails (an exception) leaves the schema as it was: the selection then refuses or
relaxes the original, as before these rules existed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from specmask.mask_service.grammar.allof_merge import merge_all_of
from specmask.mask_service.grammar.anyof_distribute import distribute
from specmask.mask_service.grammar.dependencies import expand_dependencies
from specmask.mask_service.grammar.enum_filter import filter_enum
from specmask.mask_service.grammar.integer_enum import enumerate_integers
from specmask.mask_service.grammar.schema_merge import VALIDATION_KEYWORDS, MergeContext

logger = logging.getLogger(__name__)

# A rule: (a node's validation keywords, context, draft) -> the new keywords, or None (no change).
Rule = Callable[[dict[str, Any], MergeContext, "str | None"], "dict[str, Any] | None"]

RULES: dict[str, Rule] = {
    "allOf": lambda body, ctx, _draft: merge_all_of(body, ctx),
    "dependencies": expand_dependencies,
    "anyOf": lambda body, ctx, _draft: distribute(body, ctx),
    "enum": lambda body, ctx, _draft: filter_enum(body, ctx),
    "integers": lambda body, ctx, _draft: enumerate_integers(body, ctx),
}
MAX_PASSES = 4  # rule rounds per node

_DATA_KEYS = frozenset({"const", "enum", "default", "examples", "example"})
# Name -> subschema maps (``dependencies`` values that are lists pass through unchanged).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_VALUES = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
)
_UNSAFE_KEYS = frozenset(
    {
        "$anchor",
        "$dynamicAnchor",
        "$recursiveAnchor",
        "$dynamicRef",
        "$recursiveRef",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)


def rewrite_exact(schema: Any, strict: bool, rules: tuple[str, ...] | None = None) -> tuple[Any, tuple[str, ...]]:
    """(the rewritten schema, the names of the rules that changed it); the input is not changed.

    ``rules``: the rule names to run (default: all of ``RULES``, in order)."""
    if not isinstance(schema, dict):
        return schema, ()
    targets = _unsafe_or_targets(schema)
    if targets is None:
        return schema, ()
    declared = schema.get("$schema")
    ctx = MergeContext(
        root=schema,
        strict=strict,
        refs_ignore_siblings=_draft(schema) == "old",
        boolean_schemas=not (isinstance(declared, str) and ("draft-04" in declared or "draft-03" in declared)),
    )
    active = [(n, RULES[n]) for n in (rules if rules is not None else tuple(RULES)) if n in RULES]
    applied: set[str] = set()
    try:
        out = _walk(schema, (), ctx, _draft(schema), targets, active, applied)
    except (RecursionError, ValueError, TypeError, KeyError, AttributeError) as exc:
        logger.warning("exact schema rewrite skipped: %s: %s", type(exc).__name__, exc)
        return schema, ()
    return out, tuple(sorted(applied))


def _draft(schema: dict[str, Any]) -> str | None:
    """ "old" for a declared draft 4-7, "new" for 2019-09 or later, None when undeclared or unknown."""
    declared = schema.get("$schema")
    if not isinstance(declared, str):
        return None
    if any(f"draft-0{n}" in declared for n in (3, 4, 6, 7)):
        return "old"
    if "2019-09" in declared or "2020-12" in declared:
        return "new"
    return None


def _unsafe_or_targets(schema: Any) -> set[tuple[str, ...]] | None:
    """The $ref targets of the document (JSON pointer tokens), or None where it is not safe to rewrite."""
    targets: set[tuple[str, ...]] = set()
    stack: list[tuple[Any, bool]] = [(schema, True)]
    while stack:
        node, is_root = stack.pop()
        if isinstance(node, list):
            stack.extend((sub, False) for sub in node)
            continue
        if not isinstance(node, dict):
            continue
        if _UNSAFE_KEYS & node.keys() or (
            not is_root and ("$id" in node or ("id" in node and isinstance(node["id"], str)))
        ):
            return None
        ref = node.get("$ref")
        if ref is not None:
            if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                return None
            targets.add(
                tuple(p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")) if ref != "#" else ()
            )
        for key, value in node.items():
            if key in _DATA_KEYS:
                continue
            if key in _SCHEMA_MAPS:
                if isinstance(value, dict):
                    stack.extend((sub, False) for sub in value.values())
            elif isinstance(value, (dict, list)):
                stack.append((value, False))
    return targets


def _pinned(path: tuple[str, ...], targets: set[tuple[str, ...]]) -> bool:
    """Whether a reference points inside the part of the node at ``path`` a rewrite changes."""
    n = len(path)
    return any(len(t) > n and t[:n] == path and t[n] not in ("$defs", "definitions") for t in targets)


def _walk(
    node: Any,
    path: tuple[str, ...],
    ctx: MergeContext,
    draft: str | None,
    targets: set[tuple[str, ...]],
    rules: list[tuple[str, Rule]],
    applied: set[str],
) -> Any:
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        where = (*path, key)
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {
                name: _walk(sub, (*where, name), ctx, draft, targets, rules, applied) for name, sub in value.items()
            }
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [
                _walk(sub, (*where, str(i)), ctx, draft, targets, rules, applied) for i, sub in enumerate(value)
            ]
        elif key in _SCHEMA_VALUES:
            out[key] = _walk(value, where, ctx, draft, targets, rules, applied)
        else:
            out[key] = value
    if _pinned(path, targets):
        return out
    keep = {k: v for k, v in out.items() if k not in VALIDATION_KEYWORDS}
    body = {k: v for k, v in out.items() if k in VALIDATION_KEYWORDS}
    for _ in range(MAX_PASSES):
        changed = False
        for name, rule in rules:
            new = rule(body, ctx, draft)
            if new is not None and new != body:
                body, changed = new, True
                applied.add(name)
        if not changed:
            break
    return {**keep, **body}
