"""``enum``/``const`` beside other keywords replaced by the values that pass them: applies to a
node whose ``enum``/``const`` values are all scalars (no objects or arrays).

Why exact: every instance of the node is one of the listed values, and a listed value is an
instance exactly when it passes the whole node. So ``{"enum": [values the node accepts]}``
is the same language. Each value is judged by ``jsonschema`` the way the end check judges an
output (the document's draft, references resolved against it, ``format`` asserted,
``multipleOf`` in decimal; without a declared draft, draft 7's reading of ``dependencies``
too), so a value is kept only where the end check would pass it.

Why it matters: the keywords beside the values may be ones no engine enforces (``not``,
``if``/``then``/``else``, ``multipleOf`` on xgrammar); filtered, the node is a plain ``enum``
both engines enforce. Object and array values are left alone: strict mode closes objects,
and the end check's strict reading would then judge them differently.
"""

from __future__ import annotations

import decimal
import functools
import json
from typing import Any

from specmask.mask_service.grammar.schema_merge import MergeContext
from specmask.mask_service.grammar.schema_rewrite import resolve_ref

MAX_VALUES = 1024


def filter_enum(body: dict[str, Any], ctx: MergeContext) -> dict[str, Any] | None:
    """``body`` (a node's validation keywords) as ``{"enum": [...]}``, or None where it does not apply."""
    if "const" in body:
        values = [body["const"]]
    elif isinstance(body.get("enum"), list):
        values = list(body["enum"])
    else:
        return None
    if set(body) <= {"enum", "const", "type"} and not ("enum" in body and "const" in body):
        return None  # nothing beside the values but a type, which schema_rewrite filters by already
    if len(values) > MAX_VALUES or any(isinstance(v, (dict, list)) for v in values):
        return None
    checks = judges(ctx.root, body)
    kept = [v for v in values if all(j.is_valid(v) for j in checks)]
    return {"enum": kept} if kept else None  # no value: unsatisfiable, left for the engines to refuse


def _multiple_of(validator: Any, divisor: Any, instance: Any, schema: Any) -> Any:
    """``multipleOf`` in decimal on each number's shortest round-trip spelling, as the end check
    reads it (``orchestrator.output_check.exact_multiples``, which this layer may not import)."""
    import jsonschema

    if not validator.is_type(instance, "number"):
        return
    if isinstance(divisor, float) or isinstance(instance, float):
        ok = _DECIMAL.remainder(decimal.Decimal(repr(instance)), decimal.Decimal(repr(divisor))) == 0
    else:
        ok = instance % divisor == 0
    if not ok:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor!r}")


_DECIMAL = decimal.Context(prec=700, traps=[decimal.InvalidOperation])


@functools.cache
def exact_multiples(cls: Any) -> Any:
    import jsonschema

    return jsonschema.validators.extend(cls, {"multipleOf": _multiple_of})


def judges(root: Any, body: dict[str, Any]) -> list[Any]:
    """Validators of ``body`` read as the end check reads an output (see the module doc)."""
    import jsonschema

    cls = exact_multiples(jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator))
    classes = [cls]
    if isinstance(root, dict) and "$schema" not in root and '"dependencies"' in json.dumps(root):
        classes.append(exact_multiples(jsonschema.Draft7Validator))
    return [c(root, format_checker=c.FORMAT_CHECKER).evolve(schema=body) for c in classes]


def validator_keywords(root: Any) -> frozenset[str]:
    """The keywords the end check's validator for ``root``'s draft reads (any other key is an
    annotation there); empty where that validator cannot read ``root``."""
    try:
        return frozenset(judges(root, {})[0].VALIDATORS)
    except Exception:
        return frozenset()


def refs_hide_siblings(root: Any) -> bool:
    """Whether ``root`` declares draft 3, 4, 6 or 7, whose ``$ref`` hides its sibling keywords."""
    declared = root.get("$schema") if isinstance(root, dict) else None
    return isinstance(declared, str) and any(f"draft-0{n}" in declared for n in (3, 4, 6, 7))


def judged_size(root: Any, body: Any, cap: int) -> int | None:
    """How many subschemas ``jsonschema`` may visit judging one value against ``body``: the
    size of its tree with local references expanded where they are used (a target referenced
    twice counts twice, as the validator walks it twice), or None once over ``cap``.
    Judging costs up to this per value, so callers judge only where values x size is small:
    shared references nest into exponentially many paths."""
    count = 0
    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        count += 1
        if count > cap:
            return None
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            stack.append(resolve_ref(root, ref))
        stack.extend(v for k, v in node.items() if k not in _DATA_KEYS and k not in ("$defs", "definitions"))
    return count


_DATA_KEYS = frozenset({"const", "enum", "default", "examples", "example"})
