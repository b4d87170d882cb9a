"""Rewrite a JSON-Schema ``pattern`` so the grammar engine can only emit JSON-safe string content.

xgrammar 0.2.8 matches a ``pattern`` (and a ``patternProperties`` key) against the
*raw* characters between the quotes, with no escape sequences. Whether a class
like ``.`` or ``[^a]`` may then emit a raw ``"``, ``\\`` or control character
depends on an internal choice: a pattern whose automaton is small is compiled
with JSON-string sanitising, a large one (a repetition of about 10,000 or more,
e.g. ``^.{0,20000}$``) and a plain literal (``\\t``, ``a"b``) are compiled as
written, so ``"``, ``\\`` and U+0000-U+001F come out raw: invalid JSON.

``json_safe_pattern`` removes the dependence on that choice: it parses the
pattern and re-emits it with every character class intersected with the
characters a JSON string may hold unescaped (everything except U+0000-U+001F,
``"`` and ``\\``). The result matches a subset of what the original pattern
matches under both ECMA-262 (what JSON Schema specifies and xgrammar implements)
and Python ``re`` (what ``jsonschema`` validates with), so it is stricter,
never looser:

* ``.`` / ``[^...]`` / ``\\S`` / ``\\D`` keep non-ASCII characters; ``\\d`` and
  ``\\w`` are ASCII (as in ECMA-262); ``\\W`` and classes negating ``\\w`` are
  limited to ASCII; ``\\s`` is the spaces both dialects agree on, minus controls.
* A pattern that *requires* ``"``, ``\\`` or a control character (a literal
  outside a class, or a class of only such characters) cannot be produced by
  the engine as a JSON escape, so it is refused.
* Refused as well: flags (``(?i)``), word boundaries, possessive/atomic groups,
  lookaround and backreferences (schema_check refuses those first), and
  patterns Python's parser cannot read.

Length counting is unchanged: every atom still matches exactly one code point.
"""

from __future__ import annotations

import re
import sys
from functools import cache
from typing import Any

try:  # Python 3.11+
    import re._parser as _sre  # type: ignore[import-not-found]  # private module, absent from typeshed
except ImportError:  # pragma: no cover - older Pythons
    import sre_parse as _sre

from specmask.common.ecma_regex import escape_class_dashes
from specmask.mask_service.errors import GrammarError

Ranges = list[tuple[int, int]]  # sorted, disjoint, inclusive code-point ranges

_MAX = sys.maxunicode
# Characters a JSON string may not hold raw (RFC 8259 section 7), plus the
# surrogates, which are not characters and cannot appear in UTF-8 text.
_UNSAFE: Ranges = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0xD800, 0xDFFF)]
_ASCII_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_ECMA_SPACE: Ranges = [
    (0x09, 0x0D),
    (0x20, 0x20),
    (0xA0, 0xA0),
    (0x1680, 0x1680),
    (0x2000, 0x200A),
    (0x2028, 0x2029),
    (0x202F, 0x202F),
    (0x205F, 0x205F),
    (0x3000, 0x3000),
    (0xFEFF, 0xFEFF),
]
# ECMA '.' excludes the line terminators; Python's excludes only '\n'.
_DOT_EXCLUDED: Ranges = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]


def _norm(rs: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(r for r in rs if r[0] <= r[1]):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(rs: Ranges) -> Ranges:
    out: Ranges = []
    nxt = 0
    for lo, hi in _norm(rs):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX:
        out.append((nxt, _MAX))
    return out


def _union(*sets: Ranges) -> Ranges:
    return _norm([r for s in sets for r in s])


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    return _complement(_union(_complement(a), _complement(b)))


def _scan(pred: Any) -> Ranges:
    out: Ranges = []
    start = None
    for c in range(_MAX + 1):
        if pred(chr(c)):
            if start is None:
                start = c
        elif start is not None:
            out.append((start, c - 1))
            start = None
    if start is not None:
        out.append((start, _MAX))
    return out


@cache
def _py_digit() -> tuple[tuple[int, int], ...]:
    return tuple(_scan(str.isdecimal))  # what Python's re calls \d for str patterns


@cache
def _py_space() -> tuple[tuple[int, int], ...]:
    return tuple(_scan(str.isspace))  # what Python's re calls \s for str patterns


# For each category: (lower, upper) bounds. lower is inside both dialects' sets
# (used where the class is positive), upper contains both (used where negated),
# so either way the emitted set is inside what both dialects match.
def _category(cat: Any) -> tuple[Ranges, Ranges]:
    name = str(cat)
    if name.endswith("NOT_DIGIT"):
        lo, up = _category(_sre.CATEGORY_DIGIT)
        return _complement(up), _complement(lo)
    if name.endswith("NOT_WORD"):
        lo, up = _category(_sre.CATEGORY_WORD)
        return _complement(up), _complement(lo)
    if name.endswith("NOT_SPACE"):
        lo, up = _category(_sre.CATEGORY_SPACE)
        return _complement(up), _complement(lo)
    if name.endswith("DIGIT"):
        return [(0x30, 0x39)], _union([(0x30, 0x39)], list(_py_digit()))
    if name.endswith("WORD"):
        # Python's Unicode \w has hundreds of ranges; "all non-ASCII" is a
        # superset that keeps negated classes short (they become ASCII-only).
        return list(_ASCII_WORD), _union(_ASCII_WORD, [(0x80, _MAX)])
    if name.endswith("SPACE"):
        py = list(_py_space())
        return _intersect(_ECMA_SPACE, py), _union(_ECMA_SPACE, py)
    raise GrammarError(f"unsupported regex class {name}")


class _Unsupported(Exception):
    pass


def _char(c: int) -> str:
    ch = chr(c)
    if ch.isascii() and ch.isalnum():
        return ch
    # Never ``\\xHH``: xgrammar 0.2.8's regex reader takes every hex digit after ``\\x``
    # (``\\x20a`` is U+020A, not " a"); ``\\uHHHH`` is read with exactly four.
    if c <= 0xFFFF:
        return f"\\u{c:04x}"
    return f"\\u{{{c:x}}}"


def _class_body(rs: Ranges) -> str:
    return "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in rs)


def _emit_set(rs: Ranges) -> str:
    """A regex atom for exactly the characters in rs (already JSON-safe)."""
    rs = _intersect(rs, _complement(_UNSAFE))
    if not rs:
        raise _Unsupported("it can only match '\"', '\\' or a control character, which cannot be emitted unescaped")
    if len(rs) == 1 and rs[0][0] == rs[0][1]:
        return _char(rs[0][0])
    # The complement always holds the unsafe characters; leave out the
    # surrogates, which cannot occur in the UTF-8 text being matched.
    excluded = _intersect(_complement(rs), _complement([(0xD800, 0xDFFF)]))
    if len(excluded) < len(rs):
        return f"[^{_class_body(excluded)}]"
    return f"[{_class_body(rs)}]"


def _in_set(items: list[Any]) -> Ranges:
    negate = bool(items) and items[0][0] is _sre.NEGATE
    parts: list[Ranges] = []
    for op, arg in items[1:] if negate else items:
        if op is _sre.LITERAL:
            parts.append([(arg, arg)])
        elif op is _sre.RANGE:
            parts.append([(arg[0], arg[1])])
        elif op is _sre.CATEGORY:
            lower, upper = _category(arg)
            parts.append(upper if negate else lower)
        else:
            raise _Unsupported(f"class item {op}")
    u = _union(*parts)
    return _complement(u) if negate else u


def _emit_seq(seq: Any) -> str:
    return "".join(_emit(op, arg) for op, arg in seq)


def _group(seq: Any) -> str:
    body = _emit_seq(seq)
    items = list(seq)
    if len(items) == 1 and items[0][0] in (_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN):
        return body
    return f"(?:{body})"


def _emit(op: Any, arg: Any) -> str:
    if op is _sre.LITERAL:
        return _emit_set([(arg, arg)])
    if op is _sre.NOT_LITERAL:
        return _emit_set(_complement([(arg, arg)]))
    if op is _sre.ANY:
        return _emit_set(_complement(_DOT_EXCLUDED))
    if op is _sre.IN:
        return _emit_set(_in_set(arg))
    if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT):  # lazy and greedy match the same strings
        lo, hi, sub = arg
        inner = _group(sub)
        if hi is _sre.MAXREPEAT or hi == _sre.MAXREPEAT:
            return inner + ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}")
        if (lo, hi) == (0, 1):
            # xgrammar 0.2.8's JSON-string regex reads an optional group holding a repeat
            # ("(?:ab+)?") as if its first item were optional too (it accepted "b"); the
            # alternation with the empty string is read right.
            return f"(?:{_emit_seq(sub)}|)" if inner.startswith("(?:") else inner + "?"
        return inner + (f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}")
    if op is _sre.SUBPATTERN:
        _group_id, add_flags, del_flags, sub = arg
        if add_flags or del_flags:
            raise _Unsupported("inline flags")
        return f"(?:{_emit_seq(sub)})"
    if op is _sre.BRANCH:
        return "(?:" + "|".join(_emit_seq(alt) for alt in arg[1]) + ")"
    if op is _sre.AT:
        name = str(arg)
        if name in ("AT_BEGINNING", "AT_BEGINNING_STRING"):
            return "^"
        if name in ("AT_END", "AT_END_STRING"):
            return "$"
        raise _Unsupported("word boundaries (\\b, \\B)")
    raise _Unsupported(f"the regex construct {str(op).lower()}")


def json_safe_pattern(pattern: str, where: str) -> str:
    """The pattern restricted to JSON-safe characters; raise GrammarError if that is impossible."""
    try:
        try:
            parsed = _sre.parse(pattern)
        except re.error:
            parsed = _sre.parse(escape_class_dashes(pattern))
    except re.error as exc:
        raise GrammarError(f"unsupported pattern at {where}: cannot parse {pattern!r}: {exc}") from None
    if parsed.state.flags & ~re.UNICODE:
        raise GrammarError(f"unsupported pattern at {where}: {pattern!r} uses inline flags")
    try:
        return _emit_seq(parsed)
    except _Unsupported as exc:
        raise GrammarError(f"unsupported pattern at {where}: {pattern!r}: {exc}") from None
