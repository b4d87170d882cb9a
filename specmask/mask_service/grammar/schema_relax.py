"""Checked mode: the closest enforceable SUPERSET of a JSON Schema no engine enforces exactly.

A request that opts in (``GrammarSpec.checked``) and whose schema every engine
refuses is compiled from a *relaxation* of it: a schema whose language contains
the original's. Generation is then masked by the relaxation, and the
orchestrator checks the output against the ORIGINAL schema at the end and
resamples on a violation (specmask/orchestrator/checked_retry.py), so the relaxation never
decides what is returned as valid; it only has to keep every valid document
reachable.

Each rule below removes a constraint that a grammar cannot hold token by token
(or replaces it by a weaker one). Why each only widens the language:

* ``uniqueItems``: dropped (an assertion; without it any array the rest allows).
* ``not``: dropped (an assertion; a conjunct removed from the node).
* ``oneOf`` -> ``anyOf``: "exactly one branch" implies "at least one" (next to
  an existing ``anyOf`` it becomes one more ``allOf`` branch ``{"anyOf": ...}``,
  the same conjunction).
* ``dependencies`` / ``dependentRequired`` / ``dependentSchemas``: dropped
  (conditional assertions).
* ``if`` / ``then`` / ``else``: dropped (a conditional assertion).
* ``contains`` / ``minContains`` / ``maxContains``: dropped together, leaving
  ``minItems`` of at least ``minContains`` (1 unless given): an array with that
  many matching items has at least that many items (``minItems`` asks nothing of
  a value that is not an array; not in draft 3-4, which have no ``contains``).
* ``oneOf`` -> ``anyOf`` also keeps out the JSON types two or more branches
  accept whole (``oneof_types``): such a value matches two branches, so it
  never passes the ``oneOf``. The node gets a ``type`` without them.

Every other keyword is monotone in its subschemas (``properties``, ``items``,
``anyOf``, ``allOf``, ``additionalProperties``, ``$ref``...: a wider subschema
gives a wider node). The non-monotone ones (``not``, ``oneOf``, ``if``,
``maxContains``) are all removed or replaced, so relaxing a subschema anywhere
can only widen the whole. ``tests/mask_service/test_schema_relax.py`` checks
each rule against instances.

Anything else an engine refuses (``unevaluated*``, remote or dynamic ``$ref``,
lookaround patterns, structural limits, an invalid schema) is not relaxed: the
relaxed schema is compiled through the same engines and checks, and is refused
like any other schema. A ``$ref`` that points into a relaxed keyword
(``#/oneOf/0``, ``#/not``) would lose its target, so such a schema is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.oneof_types import RelaxContext, types_never_exactly_one

# Keys whose value maps names -> subschemas.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
# Keys whose value is instance data, never a schema.
_DATA_KEYS = ("const", "enum", "default", "examples", "example")


def _drop(keys: tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    def rule(node: dict[str, Any]) -> None:
        for key in keys:
            node.pop(key, None)

    return rule


def _one_of_to_any_of(node: dict[str, Any]) -> None:
    branches = node.pop("oneOf")
    if "anyOf" not in node:
        node["anyOf"] = branches
        return
    all_of = node.get("allOf")
    node["allOf"] = [*(all_of if isinstance(all_of, list) else []), {"anyOf": branches}]


# Relaxation rules by the keyword that triggers them (registry, applied in this order).
# The name is what the service reports (``ValidateGrammarResponse.relaxed``).
RELAXATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "uniqueItems": _drop(("uniqueItems",)),
    "not": _drop(("not",)),
    "oneOf": _one_of_to_any_of,
    "dependencies": _drop(("dependencies",)),
    "dependentRequired": _drop(("dependentRequired",)),
    "dependentSchemas": _drop(("dependentSchemas",)),
    "if": _drop(("if", "then", "else")),
    "then": _drop(("if", "then", "else")),
    "else": _drop(("if", "then", "else")),
    "contains": _drop(("contains", "minContains", "maxContains")),
    "minContains": _drop(("contains", "minContains", "maxContains")),
    "maxContains": _drop(("contains", "minContains", "maxContains")),
}
# Keywords whose subtree a relaxation removes or renames: a $ref may not point into them.
_MOVED = frozenset(RELAXATIONS) - {"uniqueItems", "dependentRequired", "minContains", "maxContains"}


def relax_schema(schema: Any) -> tuple[Any, tuple[str, ...]]:
    """(the relaxed copy of ``schema``, the rule names applied, sorted); the input is not changed.

    Raises GrammarError when a ``$ref`` points into a relaxed keyword's subtree.
    """
    applied: set[str] = set()
    relaxed = _relax(schema, applied, RelaxContext.of(schema))
    if applied:
        _check_refs(schema, schema)
    return relaxed, tuple(sorted(applied))


def _relax(node: Any, applied: set[str], ctx: RelaxContext) -> Any:
    if isinstance(node, list):
        return [_relax(sub, applied, ctx) for sub in node]
    if not isinstance(node, dict):
        return node
    # Read on the node as written: a relaxed branch may accept more than the original.
    never = types_never_exactly_one(node, ctx) if "oneOf" in node else frozenset()
    min_items = ctx.contains_min_items(node)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _relax(sub, applied, ctx) for name, sub in value.items()}
        else:
            out[key] = _relax(value, applied, ctx)
    for name, rule in RELAXATIONS.items():
        if name in out:
            if name != "uniqueItems" or out[name] is not False:  # uniqueItems: false constrains nothing
                applied.add(name)
            rule(out)
    if min_items:
        current = out.get("minItems")
        out["minItems"] = max(min_items, current if isinstance(current, int) and not isinstance(current, bool) else 0)
    if never:
        kept = ctx.types_without(out.get("type"), never)
        if kept is not None:
            out["type"] = kept
    return out


def _check_refs(node: Any, root: Any) -> None:
    if isinstance(node, list):
        for sub in node:
            _check_refs(sub, root)
        return
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        moved = _moved_keyword(ref, root)
        if moved:
            raise GrammarError(
                f"checked mode cannot relax this schema: $ref {ref!r} points into '{moved}', which the relaxation "
                "removes or rewrites"
            )
    for key, value in node.items():
        if key in _DATA_KEYS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for sub in value.values():
                _check_refs(sub, root)
        elif isinstance(value, (dict, list)):
            _check_refs(value, root)


def _moved_keyword(ref: str, root: Any) -> str | None:
    """The relaxed keyword a JSON pointer passes through at a keyword position, or None."""
    node: Any = root
    name_next = False  # the previous segment was a map of names (properties, $defs...)
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and not name_next and part in _MOVED:
            return part
        name_next = isinstance(node, dict) and not name_next and part in _SCHEMA_MAPS
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return None
