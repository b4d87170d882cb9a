"""A bounded number whose every instance is an integer, beside keywords no engine enforces, as
the ``enum`` of its values: applies where ``type`` is ``integer`` or ``number``, every instance
is provably an integer (``_integral``), both bounds are finite and at most ``MAX_VALUES``
integers lie between them, and ``not``, ``if``, ``oneOf`` or ``multipleOf`` appears in the node
or below it (else the engines enforce it as it is, or the other rules make them).

Integral: the node, an ``allOf`` branch or a ``$ref`` target (its *conjuncts*: every instance
passes each) has ``type: integer`` or an integral ``multipleOf`` (a multiple of an integer is
an integer), or an ``anyOf``/``oneOf`` whose branches are all integral. Bounds: the tightest
over the conjuncts. Draft 4-7 read a ``$ref`` without its siblings, and so does this.

Why exact: every instance is an integer within the bounds, so the node's language is the
set of those integers that pass it; each is judged by ``jsonschema`` the way the end check
judges an output (``enum_filter``'s judges: the document's draft, references resolved,
``multipleOf`` in decimal), the whole node at once (unions, ``not``, references and all).
The one difference is spelling: JSON Schema counts ``5.0`` as an integer, and the enum emits
``5`` only (stricter, never looser).

Why it matters: ``not``/``if`` are refused by both engines, so such a schema was served only
in checked mode, where the relaxation drops the assertion and a model tends to write a value
it forbids (bench.checked_fallback: ``not: {"multipleOf": 2}``, ``not: {"const": 169}``, a
number in (-300, 0) under ``anyOf``s of ``multipleOf`` and ``not``).
"""

from __future__ import annotations

import math
from typing import Any

from specmask.mask_service.grammar.enum_filter import judged_size, judges
from specmask.mask_service.grammar.schema_merge import MergeContext
from specmask.mask_service.grammar.schema_rewrite import resolve_ref

MAX_VALUES = 4096
MAX_DEPTH = 16  # conjuncts and unions followed this deep (a $ref counts)
MAX_CONJUNCTS = 64  # conjuncts gathered per node: more, and the rule does not apply
MAX_JUDGED = 200_000  # values x subschemas judged (enum_filter.judged_size): past it, the rule does not apply
MAX_VISITS = 4096  # subschemas visited per node (shared references can repeat): past it, no proof
_UNENFORCED = frozenset({"not", "if", "oneOf", "multipleOf"})
_DATA_KEYS = frozenset({"const", "enum", "default", "examples", "example"})


def enumerate_integers(body: dict[str, Any], ctx: MergeContext) -> dict[str, Any] | None:
    """``body`` (a node's validation keywords) as ``{"enum": [...]}``, or None where it does not apply."""
    if body.get("type") not in ("integer", "number") or "enum" in body or "const" in body:
        return None  # enum_filter's, or not a number
    if "$ref" in body and ctx.refs_ignore_siblings:
        return None  # draft 4-7 ignore the type beside the reference: instances need not be numbers
    if not _mentions(body, ctx.root, _UNENFORCED, set()):
        return None
    budget = [MAX_VISITS]
    conjuncts = _conjuncts(body, ctx, 0, set(), budget)
    if conjuncts is None or not any(_integral(c, ctx, 0, budget) for c in conjuncts):
        return None
    bounds = _bounds(conjuncts)
    if bounds is None:
        return None
    low, high = bounds
    if high < low or high - low + 1 > MAX_VALUES:
        return None
    size = judged_size(ctx.root, body, MAX_JUDGED)
    if size is None or size * (high - low + 1) > MAX_JUDGED:
        return None  # judging every value would cost too much (shared references)
    checks = judges(ctx.root, body)
    kept = [v for v in range(low, high + 1) if all(j.is_valid(v) for j in checks)]
    return {"enum": kept} if kept else None  # no value: left for the engines to refuse


def _target(node: dict[str, Any], ctx: MergeContext) -> Any:
    """The local ``$ref`` target of ``node`` (``True``: none), or None where it cannot be read."""
    ref = node.get("$ref")
    if ref is None:
        return True
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    return resolve_ref(ctx.root, ref)


def _conjuncts(
    node: Any, ctx: MergeContext, depth: int, seen: set[str], budget: list[int]
) -> list[dict[str, Any]] | None:
    """Schemas every instance of ``node`` passes (itself, its ``allOf`` branches, its ``$ref``
    target, recursively), or None where a reference cannot be followed."""
    budget[0] -= 1
    if node is True or node == {}:
        return []
    if not isinstance(node, dict) or depth > MAX_DEPTH or budget[0] < 0:
        return None
    out: list[dict[str, Any]] = []
    if len(seen) > MAX_CONJUNCTS:
        return None
    if "$ref" in node:
        ref = node["$ref"]
        target = _target(node, ctx)
        if target is None or ref in seen:
            return None
        inner = _conjuncts(target, ctx, depth + 1, seen | {ref}, budget)
        if inner is None:
            return None
        if ctx.refs_ignore_siblings:
            return inner
        out.extend(inner)
    out.append(node)
    all_of = node.get("allOf")
    for branch in all_of if isinstance(all_of, list) else ():
        inner = _conjuncts(branch, ctx, depth + 1, seen, budget)
        if inner is None or len(out) + len(inner) > MAX_CONJUNCTS:
            return None  # a reference shared many times over: not worth the walk
        out.extend(inner)
    return out


def _integral(node: dict[str, Any], ctx: MergeContext, depth: int, budget: list[int]) -> bool:
    """Whether every instance of ``node`` read alone (not its conjuncts) is an integer."""
    if "$ref" in node and ctx.refs_ignore_siblings:
        return False  # its siblings are not read: _conjuncts gave its target instead
    if node.get("type") == "integer":
        return True
    step = node.get("multipleOf")
    if isinstance(step, (int, float)) and not isinstance(step, bool) and step > 0 and float(step).is_integer():
        return True
    if depth >= MAX_DEPTH or budget[0] < 0:
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if not isinstance(branches, list) or not branches or len(branches) > MAX_CONJUNCTS:
            continue
        if all(_branch_integral(b, ctx, depth + 1, budget) for b in branches):
            return True
    return False


def _branch_integral(branch: Any, ctx: MergeContext, depth: int, budget: list[int]) -> bool:
    conjuncts = _conjuncts(branch, ctx, depth, set(), budget)
    return conjuncts is not None and any(_integral(c, ctx, depth, budget) for c in conjuncts)


def _mentions(node: Any, root: Any, keys: frozenset[str], seen: set[str]) -> bool:
    """Whether a keyword of ``keys`` appears in ``node`` or in a local ``$ref`` target below it."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if keys & item.keys():
                return True
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and ref not in seen:
                seen.add(ref)
                stack.append(resolve_ref(root, ref))
            stack.extend(v for k, v in item.items() if k not in _DATA_KEYS)
    return False


def _bounds(conjuncts: list[dict[str, Any]]) -> tuple[int, int] | None:
    """The smallest and largest integer the conjuncts' numeric bounds allow, or None where one is missing."""
    low, high = -math.inf, math.inf
    for node in conjuncts:
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            value = node.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return None  # draft-04 boolean exclusives are read with their own bound; not here
            if key == "minimum":
                low = max(low, math.ceil(value))
            elif key == "exclusiveMinimum":
                low = max(low, math.floor(value) + 1)
            elif key == "maximum":
                high = min(high, math.floor(value))
            else:
                high = min(high, math.ceil(value) - 1)
    if math.isinf(low) or math.isinf(high):
        return None
    return int(low), int(high)
