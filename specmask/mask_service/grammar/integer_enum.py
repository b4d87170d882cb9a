"""A bounded ``integer`` schema beside keywords no engine enforces, as the ``enum`` of its values:
applies where ``type`` is ``integer``, both bounds are finite and at most ``MAX_VALUES``
integers lie between them, and the node holds ``not``, ``if`` or ``multipleOf`` (else the
engines enforce it as it is).

Why exact: every instance is an integer within the bounds, so the node's language is the
set of those integers that pass it; each is judged by ``jsonschema`` the way the end check
judges an output (``enum_filter``'s judges: the document's draft, references resolved,
``multipleOf`` in decimal). The one difference is spelling: JSON Schema counts ``5.0`` as an
integer, and the enum emits ``5`` only (stricter, never looser).

Why it matters: ``not``/``if`` are refused by both engines, so such a schema was served only
in checked mode, where the relaxation drops the assertion and a model tends to write a value
it forbids (bench.checked_fallback: ``not: {"multipleOf": 2}``, ``not: {"const": 169}``).
"""

from __future__ import annotations

import math
from typing import Any

from specmask.mask_service.grammar.enum_filter import judges
from specmask.mask_service.grammar.schema_merge import MergeContext

MAX_VALUES = 4096
_UNENFORCED = ("not", "if", "multipleOf")


def enumerate_integers(body: dict[str, Any], ctx: MergeContext) -> dict[str, Any] | None:
    """``body`` (a node's validation keywords) as ``{"enum": [...]}``, or None where it does not apply."""
    if body.get("type") != "integer" or not any(k in body for k in _UNENFORCED):
        return None
    if any(k in body for k in ("enum", "const", "anyOf", "oneOf", "allOf")):
        return None  # enum_filter's, or a union the other rules read
    bounds = _bounds(body)
    if bounds is None:
        return None
    low, high = bounds
    if high < low or high - low + 1 > MAX_VALUES:
        return None
    checks = judges(ctx.root, body)
    kept = [v for v in range(low, high + 1) if all(j.is_valid(v) for j in checks)]
    return {"enum": kept} if kept else None  # no value: left for the engines to refuse


def _bounds(body: dict[str, Any]) -> tuple[int, int] | None:
    """The smallest and largest integer the numeric bounds allow, or None where one is missing."""
    low, high = -math.inf, math.inf
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        value = body.get(key)
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
