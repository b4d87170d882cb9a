"""``dependentRequired`` / ``dependentSchemas`` / ``dependencies`` expanded into an ``anyOf`` of
object shapes: applies to an object schema whose dependency triggers not already required
are at most ``MAX_OPTIONAL_TRIGGERS``, where each shape merges exactly (``schema_merge``).

What the keywords say: if the instance has the trigger property ``k``, it must also have
the listed names (``dependentRequired``, draft 4-7 ``dependencies`` with a list) or satisfy
a schema (``dependentSchemas``, ``dependencies`` with a schema). Over the set ``D`` of
triggers, every object has some subset ``S`` of them present. For each ``S`` closed under
the dependencies (a present trigger's required names that are triggers themselves are in
``S``), the shape is the node with ``S`` and the names it requires added to ``required``,
the triggers outside ``S`` forbidden, and the schemas of the triggers in ``S`` merged in.
Every object matches exactly the shape of its own ``S`` (or none, when its ``S`` is not
closed, i.e. a dependency is broken), so the ``anyOf`` is the original's language, and the
shapes are disjoint (they differ in which triggers are present), so ``oneOf`` would read
the same. A trigger in ``required`` is always present: it doubles nothing.

A forbidden trigger is left out of ``properties`` where the object is closed
(``additionalProperties: false``, or strict mode's closed object), else declared ``false``
(llguidance reads that; xgrammar refuses it, so the selection moves on). A name a present
trigger requires that ``properties`` does not declare is declared with the object's
additional schema (strict mode: ``{}``, as the end check's strict reading declares it), or
makes the shape impossible where the object forbids extra names (``additionalProperties:
false``; in strict mode, an undeclared trigger nothing requires).

Drafts: ``dependencies`` means something only to drafts 4-7 and ``dependent*`` only to
2019-09 and later. Where the document declares a draft (``$schema``) that ignores the
keyword, the keyword is dropped (it is an annotation there); without ``$schema`` both are
enforced, as the end check enforces both readings.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

from specmask.mask_service.grammar.schema_merge import (
    MergeContext,
    effective_additional,
    inline,
    lists_properties,
    merge,
    size,
)
from specmask.mask_service.grammar.schema_rewrite import types_of

# At most 2**MAX_OPTIONAL_TRIGGERS shapes per node.
MAX_OPTIONAL_TRIGGERS = 5
MAX_SIZE_BYTES = 128 * 1024
KEYWORDS = ("dependencies", "dependentRequired", "dependentSchemas")


def expand_dependencies(body: dict[str, Any], ctx: MergeContext, draft: str | None) -> dict[str, Any] | None:
    """``body`` (a node's validation keywords) with its dependency keywords expanded, or None.

    ``draft``: "old" (a declared draft 4-7), "new" (2019-09 or later), None (undeclared)."""
    if not any(k in body for k in KEYWORDS):
        return None
    names: dict[str, list[str]] = {}
    schemas: dict[str, list[Any]] = {}
    for key in KEYWORDS:
        value = body.get(key)
        if value is None or (draft == "new" and key == "dependencies") or (draft == "old" and key != "dependencies"):
            continue
        if not isinstance(value, dict):
            return None
        for trigger, dep in value.items():
            if isinstance(dep, list) and all(isinstance(n, str) for n in dep):
                names.setdefault(trigger, []).extend(n for n in dep if n not in names.get(trigger, []))
            elif isinstance(dep, (dict, bool)) and key != "dependentRequired":
                if dep is not True and dep != {}:
                    schemas.setdefault(trigger, []).append(dep)
            else:
                return None
    rest = {k: v for k, v in body.items() if k not in KEYWORDS}
    if not names and not schemas:
        return rest  # only keywords the declared draft ignores
    if any(k in rest for k in ("anyOf", "oneOf", "allOf", "not", "if", "patternProperties")):
        return None
    t = types_of(rest.get("type"))
    if None not in t and "object" not in t:
        return rest  # no object passes the node: the dependencies never apply
    # Instances of the node's other types pass the dependencies: one more branch keeps them.
    others = [n for n in _NON_OBJECT if None in t or n in t or (n == "integer" and "number" in t)]
    if "number" in others:
        others.remove("integer")
    if ctx.strict and not lists_properties(rest):
        return None  # a forbidden trigger would be declared, and strict mode would then close the object
    triggers = [*names, *(k for k in schemas if k not in names)]
    required = (
        [r for r in rest.get("required", []) if isinstance(r, str)] if isinstance(rest.get("required"), list) else []
    )
    optional = [k for k in triggers if k not in required]
    if len(optional) > MAX_OPTIONAL_TRIGGERS:
        return None
    shapes = []
    for bits in itertools.product((False, True), repeat=len(optional)):
        present = {k for k, on in zip(optional, bits, strict=True) if on} | (set(triggers) & set(required))
        if _closure(present, names, triggers) != present:
            continue  # a present trigger requires an absent one: no object has this set
        shape = _shape(rest, present, [k for k in triggers if k not in present], names, required, ctx)
        if shape is _IMPOSSIBLE:
            continue
        if shape is None:
            return None
        for trigger in sorted(present):
            for dep in schemas.get(trigger, []):
                if ctx.strict and _union_into_closed(rest, dep, ctx):
                    return None
                shape = None if dep is False else merge(shape, dep, ctx, b_strict=False)
                if shape is None:
                    break
            if shape is None:
                break
        if shape is None:
            if any(dep is False for k in present for dep in schemas.get(k, [])):
                continue  # a trigger whose schema is false cannot be present
            return None
        shape["type"] = "object"
        shapes.append(shape)
    if others:
        shapes.append({**copy.deepcopy(rest), "type": others[0] if len(others) == 1 else others})
    if not shapes or size(shapes) > MAX_SIZE_BYTES:
        return None
    return shapes[0] if len(shapes) == 1 else {"anyOf": shapes}


_IMPOSSIBLE: Any = object()
_NON_OBJECT = ("null", "boolean", "number", "integer", "string", "array")


def _union_into_closed(rest: dict[str, Any], dep: Any, ctx: MergeContext) -> bool:
    """Whether a dependent schema would put a union beside an object only strict mode closes.

    The end check's strict reading closes that object without the dependent schema (an
    assertion); merged, properties beside ``anyOf``/``oneOf`` are an intersection llguidance's
    reading leaves open. The readings differ, so the node is not rewritten."""
    resolved = inline(dep, ctx)
    implicit = "additionalProperties" not in rest and effective_additional(rest, ctx.strict) is False
    return implicit and (not isinstance(resolved, dict) or any(k in resolved for k in ("anyOf", "oneOf", "allOf")))


def _closure(present: set[str], names: dict[str, list[str]], triggers: list[str]) -> set[str]:
    out = set(present)
    while True:
        more = {n for k in out for n in names.get(k, []) if n in triggers} - out
        if not more:
            return out
        out |= more


def _shape(
    rest: dict[str, Any],
    present: set[str],
    absent: list[str],
    names: dict[str, list[str]],
    required: list[str],
    ctx: MergeContext,
) -> Any:
    """The node for one set of present triggers (before their schemas are merged), None where
    it cannot be written exactly, ``_IMPOSSIBLE`` where no object has it."""
    shape = copy.deepcopy(rest)
    props = shape.setdefault("properties", {})
    if not isinstance(props, dict):
        return None
    extra = effective_additional(rest, ctx.strict)
    must = [*required, *(k for k in sorted(present) if k not in required)]
    for k in sorted(present):
        must.extend(n for n in names.get(k, []) if n not in must)
    # Names strict mode's reading declares when undeclared (output_check.strict_schema):
    # required ones, and the ones a dependency requires; a trigger alone is not among them.
    declarable = set(required) | {n for k in present for n in names.get(k, [])}
    for name in must:
        if name in props:
            if props[name] is False:
                return _IMPOSSIBLE
            continue
        if rest.get("additionalProperties") is False or (extra is False and name not in declarable):
            return _IMPOSSIBLE
        props[name] = copy.deepcopy(extra) if isinstance(extra, dict) else {}
    for k in absent:
        if extra is False:
            props.pop(k, None)  # closed: an undeclared name cannot appear
        else:
            props[k] = False if ctx.boolean_schemas else {"not": {}}  # draft 4 has no boolean schemas
    if must:
        shape["required"] = must
    return shape
