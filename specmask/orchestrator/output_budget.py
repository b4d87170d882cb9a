"""Whether a JSON Schema's shortest document can fit in a request's token budget.

``minLength: 100000`` or ``minItems: 1000000`` compile fine, but no output can complete
within a few hundred tokens: every such request ran to max_tokens and ended by length.
``min_json_chars`` is a lower bound on the length of any JSON text the schema accepts
(it never overestimates: whatever it does not understand counts as one character), and
``min_tokens`` divides it by the longest token of the vocabulary, so a refusal is sound:
the refused request could not have completed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

# Bounds grow by products (minItems of minItems); past this they only need to exceed any budget.
_CAP = 10**12
_MAX_DEPTH = 64  # deeper nesting counts as one character: a lower bound still
_FIXED = {"boolean": 4, "null": 4}  # "true"/"false" >= 4, "null" = 4


def _literal(value: Any) -> int:
    """Shortest spelling of a const/enum value: a string's characters (each >= 1) and its quotes;
    anything else at least one character (1.0 may be written 1)."""
    return len(value) + 2 if isinstance(value, str) else 1


def _min_over(bounds: Iterable[int]) -> int:
    return min(bounds, default=1)


def min_json_chars(schema: Any, depth: int = 0) -> int:
    """A lower bound on the characters of any JSON text that ``schema`` accepts."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return 1
    bounds = [1]
    if "const" in schema:
        bounds.append(_literal(schema["const"]))
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        bounds.append(_min_over(_literal(v) for v in enum))
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            bounds.append(_min_over(min_json_chars(b, depth + 1) for b in branches))
    all_of = schema.get("allOf")
    if isinstance(all_of, list):
        bounds.extend(min_json_chars(b, depth + 1) for b in all_of)
    types = schema.get("type")
    if isinstance(types, str):
        types = [types]
    if isinstance(types, list) and types and all(isinstance(t, str) for t in types):
        bounds.append(_min_over(_typed(schema, t, depth) for t in types))
    return min(max(bounds), _CAP)


def _int(schema: dict[str, Any], key: str) -> int:
    value = schema.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _typed(schema: dict[str, Any], kind: str, depth: int) -> int:
    if kind == "string":
        return _int(schema, "minLength") + 2
    if kind == "array":
        n = _int(schema, "minItems")
        if not n:
            return 2
        items = schema.get("items")
        each = min_json_chars(items, depth + 1) if isinstance(items, dict) and "prefixItems" not in schema else 1
        return min(2 + n * each + (n - 1), _CAP)
    if kind == "object":
        required = (
            [k for k in schema.get("required", ()) if isinstance(k, str)]
            if isinstance(schema.get("required"), list)
            else []
        )
        found = schema.get("properties")
        properties: dict[str, Any] = found if isinstance(found, dict) else {}
        members = [len(k) + 3 + min_json_chars(properties.get(k), depth + 1) for k in dict.fromkeys(required)]
        by_required = 2 + sum(members) + max(len(members) - 1, 0)
        n = _int(schema, "minProperties")
        by_count = 2 + n * 4 + max(n - 1, 0)  # '"":0' is the shortest member
        return min(max(by_required, by_count), _CAP)
    return _FIXED.get(kind, 1)


def min_tokens(schema_text: str, max_token_chars: int) -> tuple[int, int] | None:
    """(lower bound in characters, in tokens) of any document of the schema; None if it is not JSON."""
    try:
        schema = json.loads(schema_text)
    except (ValueError, RecursionError):
        return None
    try:
        chars = min_json_chars(schema)
    except RecursionError:
        return None
    return chars, math.ceil(chars / max(max_token_chars, 1))


def longest_token_chars(vocab: Iterable[str]) -> int:
    """An upper bound on the characters one token decodes to: the longest vocabulary entry
    (byte-level entries spell one byte per character; a character is at least one byte)."""
    return max((len(piece) for piece in vocab), default=1)
