"""xgrammar's printed EBNF written so that it re-parses as the same grammar.

The mask service rewrites xgrammar's *printed* grammar (surrogate-free classes,
JSON-safe length classes) and parses the text again, and the HTTP tool-call
grammar embeds a printed JSON-schema grammar in a larger EBNF text. xgrammar
0.2.8 prints U+0001-U+0006, U+000E-U+001F and U+007F-U+00FF as ``\\xHH`` (two
hex digits), but its parser reads ``\\x`` followed by *every* hex digit that
follows. So a literal or class where such a character is followed by
``0-9a-fA-F`` comes back as another code point: the printed ``"\\xe7ade"`` of
``const: "çade"`` ("façade", "Décembre", "Ñandú") re-parses as U+E7ADE + nothing,
and the grammar never accepts the caller's literal (every request for such a
schema failed its end check). ``\\uHHHH`` and ``\\UHHHHHHHH`` are read with
exactly four and eight digits, so ``unambiguous_escapes`` rewrites each printed
``\\xHH`` as ``\\u00HH`` (in string literals, ``Regex("...")`` text included, and
in character classes); nothing else changes.

``reparse_exactly`` also parses the result and compares its print with the
original: any other printer/parser disagreement (a future xgrammar, a form not
met yet) refuses the grammar instead of compiling a different one.
Known left alone: xgrammar's printer cuts a string literal at U+0000 (the
grammar of ``"a\\0b"`` prints as ``"a"``). JSON schemas never put U+0000 in a
literal (it is JSON-escaped), but a regex, EBNF or Lark literal holding it loses
its tail on re-parse, and the check above sees that only when the cut changes
the printed form. The end check reads the caller's own grammar, so such output
fails its request rather than passing.
Checked by tests/mask_service/test_mask_unicode_literals.py.
"""

from __future__ import annotations

import re

from specmask.mask_service.errors import GrammarError

# One escape of xgrammar's printer (or an escaped backslash, so ``\\\\xe7`` stays text).
_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|.)", re.DOTALL)


def _fix(body: str) -> str:
    return _ESCAPE.sub(lambda m: f"\\u00{m.group(1).lower()}" if m.group(1) else m.group(0), body)


def unambiguous_escapes(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printed form) with every ``\\xHH`` in a literal or class written ``\\u00HH``."""
    if "\\x" not in ebnf:
        return ebnf
    out: list[str] = []
    i, n = 0, len(ebnf)
    while i < n:
        ch = ebnf[i]
        if ch in '"[':
            close = '"' if ch == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ch + _fix(ebnf[i + 1 : j]) + ebnf[j : j + 1])
            i = j + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def reparse_exactly(printed: str) -> str:
    """``printed`` (xgrammar's print of a grammar) as text that parses back to the same grammar.

    Raises GrammarError when the parsed text does not print as ``printed`` does
    (the grammar engine cannot carry this grammar through its text form)."""
    import xgrammar as xgr

    text = unambiguous_escapes(printed)
    try:
        again = str(xgr.Grammar.from_ebnf(text))
    except (RuntimeError, ValueError) as exc:
        raise GrammarError(f"the grammar engine cannot re-read its own grammar text: {exc}") from None
    if again != printed:
        raise GrammarError(
            "the grammar engine's text form of this grammar does not read back as the same grammar "
            "(a string literal holding U+0000?); refusing it rather than enforcing a different one"
        )
    return text
