"""Code points a grammar may name: Unicode scalar values only.

A lone surrogate (U+D800-U+DFFF) is not a character and has no UTF-8 form;
xgrammar 0.2.8 compiles ``root ::= "\\uD800"`` into the bytes ED A0 80 anyway,
so the "complete" output was not text at all. A value above U+10FFFF is no code
point. ``bad_code_point`` finds either, raw or as an escape (``\\uD800``,
``\\u{D800}``, ``\\U0000D800``, ``\\x{D800}``), in regex / EBNF / Lark source
and in JSON Schema patterns. A surrogate *pair* written as two escapes is
refused as well: xgrammar does not combine them (write ``\\U0001F600``).
"""

from __future__ import annotations

import re

_MAX_CODE_POINT = 0x10FFFF
# An escape naming a code point, preceded by an even number of backslashes
# (``\\\\uD800`` is a backslash followed by the text "uD800", not an escape).
_CODE_POINT_ESCAPE = re.compile(
    r"(?<!\\)(?:\\\\)*\\(?:u\{([0-9a-fA-F]{1,8})\}|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|x\{([0-9a-fA-F]{1,8})\})"
)


def _describe(cp: int) -> str | None:
    if 0xD800 <= cp <= 0xDFFF:
        return f"U+{cp:04X} is a lone surrogate, not a character, and cannot be encoded as UTF-8"
    if cp > _MAX_CODE_POINT:
        return f"U+{cp:X} is above U+10FFFF, the last Unicode code point"
    return None


def bad_code_point(text: str) -> str | None:
    """Why ``text`` (grammar or regex source) names a code point that is not a character; None if it does not."""
    for i, ch in enumerate(text):
        problem = _describe(ord(ch))
        if problem:
            return f"offset {i}: {problem}"
    for m in _CODE_POINT_ESCAPE.finditer(text):
        digits = next(g for g in m.groups() if g is not None)
        problem = _describe(int(digits, 16))
        if problem:
            escape = m.group(0).lstrip("\\")
            return (
                f"escape \\{escape} at offset {m.start()}: {problem} (a character above U+FFFF is written as one "
                "escape, e.g. \\U0001F600, not as a surrogate pair)"
            )
    return None
