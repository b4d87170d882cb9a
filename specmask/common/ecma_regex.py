"""JSON Schema regular expressions (ECMA-262) read exactly by Python's ``re``.

JSON Schema's ``pattern`` and ``patternProperties`` are ECMA-262 regexes, but
``jsonschema`` runs them with ``re.search``, which reads several of them more
loosely than ECMA-262 does:

* ``$`` also matches before a final ``\\n`` (``^a$`` accepts ``"a\\n"``);
* ``.`` matches ``\\r``, U+2028 and U+2029, which are line terminators in ECMA-262;
* ``\\d`` and ``\\w`` match any Unicode digit or word character (``"١٢٣"`` is
  ``\\d+`` to Python, not to ECMA-262), ``\\b`` follows them;
* ``\\s`` matches U+001C..U+001F and U+0085, which ECMA-262's ``\\s`` does not.

The end-of-request check must never be looser than the schema (a relaxed or
checked grammar could produce exactly those strings), so it validates against
``ecma_schema(schema)``: the same schema with each regex rewritten to a Python
regex with ECMA-262's meaning. Inside a character class, ``\\D``, ``\\W`` and
``\\S`` keep Python's meaning, which is stricter (they exclude more), never looser.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ecma_schema", "ecma_to_python", "escape_class_dashes"]

# ECMA-262 WhiteSpace and LineTerminator code points (what ``\s`` matches there).
_ECMA_SPACE = "\\t\\n\\v\\f\\r \\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000\\ufeff"
_DIGIT = "0-9"
_WORD = "A-Za-z0-9_"
# Escapes rewritten outside a class, and inside one (where only the positive ones have a
# plain range form; a negated class escape inside a class keeps Python's stricter reading).
_OUTSIDE = {
    "d": f"[{_DIGIT}]",
    "D": f"[^{_DIGIT}]",
    "w": f"[{_WORD}]",
    "W": f"[^{_WORD}]",
    "s": f"[{_ECMA_SPACE}]",
    "S": f"[^{_ECMA_SPACE}]",
    "b": "(?a:\\b)",
    "B": "(?a:\\B)",
}
_INSIDE = {"d": _DIGIT, "w": _WORD, "s": _ECMA_SPACE}
_DOT = "[^\\n\\r\\u2028\\u2029]"
# Keys whose values are data, not schemas: their strings are never regexes.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def ecma_to_python(pattern: str) -> str:
    """``pattern`` (ECMA-262, no flags) as a Python regex that matches the same strings."""
    # A '-' beside a class escape ([\w-.]) is a literal to ECMA-262; escaped, Python reads it so too.
    pattern = escape_class_dashes(pattern)
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            table = _INSIDE if in_class else _OUTSIDE
            out.append(table.get(nxt, ch + nxt))
            i += 2
            continue
        if in_class:
            if ch == "]":
                in_class = False
            out.append(ch)
        elif ch == "[":
            in_class = True
            out.append(ch)
            # A ']' first in the class (after an optional '^') is a literal to Python; ECMA-262
            # reads '[]' as the empty class and '[^]' as any character. Write both explicitly.
            rest = pattern[i + 1 :]
            if rest.startswith("]"):
                out[-1] = "(?!)"
                in_class = False
                i += 2
                continue
            if rest.startswith("^]"):
                out[-1] = "[\\s\\S]"
                in_class = False
                i += 3
                continue
        elif ch == "$":
            out.append("\\Z")
        elif ch == ".":
            out.append(_DOT)
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def ecma_schema(node: Any) -> Any:
    """A copy of the schema ``node`` with every ``pattern`` and ``patternProperties`` key
    rewritten by ``ecma_to_python``; data keywords (``const``, ``enum``, ...) are copied as is."""
    if isinstance(node, list):
        return [ecma_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            out[key] = ecma_to_python(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ecma_to_python(k) if isinstance(k, str) else k: ecma_schema(v) for k, v in value.items()}
        elif key == "properties" and isinstance(value, dict):
            # Property names are names, not keywords: a property called "pattern" is not a regex.
            out[key] = {k: ecma_schema(v) for k, v in value.items()}
        else:
            out[key] = ecma_schema(value)
    return out


_CLASS_ESCAPES = set("dDwWsS")


def escape_class_dashes(pattern: str) -> str:
    """Escape a '-' next to a class escape inside [...] (ECMA reads it literally; Python rejects it)."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            pair = pattern[i : i + 2]
            if in_class and pair[1] in _CLASS_ESCAPES:
                if out and out[-1] == "-" and len(out) >= 2 and out[-2] != "[" and out[-2] != "[^":
                    out[-1] = "\\-"
                out.append(pair)
                if pattern[i + 2 : i + 3] == "-" and pattern[i + 3 : i + 4] not in ("]", ""):
                    out.append("\\-")
                    i += 3
                    continue
            else:
                out.append(pair)
            i += 2
            continue
        if not in_class and ch == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "^":
                out.append("[^")
                i += 2
                continue
        elif in_class and ch == "]" and out and out[-1] not in ("[", "[^"):
            in_class = False
        out.append(ch)
        i += 1
    return "".join(out)
