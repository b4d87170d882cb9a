"""Character classes in xgrammar's printed EBNF narrowed to Unicode scalar values.

xgrammar 0.2.8 matches a character class over code points and encodes each as
UTF-8 bytes without excluding the surrogates U+D800-U+DFFF, so a negated class
(``[^\\0-\\x1f\\"\\\\\\r\\n]``, the character rule of every JSON string) or a
range across U+D800 (``[\\0-\\U0010ffff]``, what ``.`` prints as) also accepts
the three-byte sequences ED A0 80 .. ED BF BF. Those are not UTF-8: with a
byte-level vocabulary a sampler can emit them token by token inside a JSON
string, and the decoded text then differs from what the grammar accepted (each
byte becomes U+FFFD, which can break ``maxLength`` or ``pattern``).

``exclude_surrogates`` rewrites a printed grammar (of a JSON schema, regex,
EBNF or Lark text; ``compile_scalar_only``) so every class excludes them: a
negated class gets ``\\ud800-\\udfff`` added to what it excludes, a positive
range that reaches into the block is split around it.
String literals, including the regex text of ``Regex("...")`` rules (patterns,
which ``json_regex`` already keeps free of surrogates), are left alone; so a
``Regex("...")`` rule written in a caller's EBNF keeps xgrammar's classes (a
known gap). The printed grammar is re-parsed, so a form the printer does not
print faithfully is refused first (``unfaithful_print``), and the printer's
``\\xHH`` escapes are made unambiguous before re-parsing (``ebnf_escapes``).
Checked by tests/mask_service/test_mask_never_lie_grammars.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from specmask.mask_service.grammar.ebnf_escapes import reparse_exactly, unambiguous_escapes

_SURROGATES = (0xD800, 0xDFFF)
_EXCLUSION = "\\ud800-\\udfff"
# One class item of xgrammar's printer: an escape or a single character.
_ITEM = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)|.", re.DOTALL)
_SIMPLE_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "0": 0x00, "b": 0x08, "f": 0x0C, "v": 0x0B}


def _code_point(item: str) -> int:
    if not item.startswith("\\") or len(item) == 1:
        return ord(item)
    body = item[1:]
    if body[0] in "xuU" and len(body) > 1:
        return int(body[1:], 16)
    return _SIMPLE_ESCAPES.get(body, ord(body))


def _positive_class(body: str) -> str:
    """A positive class body with any range that covers a surrogate split around the block."""
    items = _ITEM.findall(body)
    ranges: list[tuple[int, int]] = []
    i = 0
    while i < len(items):
        lo = _code_point(items[i])
        if i + 2 < len(items) and items[i + 1] == "-":
            ranges.append((lo, _code_point(items[i + 2])))
            i += 3
        else:
            ranges.append((lo, lo))
            i += 1
    if not any(lo <= _SURROGATES[1] and hi >= _SURROGATES[0] for lo, hi in ranges):
        return body
    out = []
    for lo, hi in ranges:
        for a, b in ((lo, min(hi, _SURROGATES[0] - 1)), (max(lo, _SURROGATES[1] + 1), hi)):
            if a <= b:
                out.append(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}")
    return "".join(out)


def exclude_surrogates(ebnf: str) -> str:
    """xgrammar's printed EBNF with every character class limited to Unicode scalar values."""
    out: list[str] = []
    i, n = 0, len(ebnf)
    while i < n:
        ch = ebnf[i]
        if ch == '"':  # a string literal (also a Regex("...") rule's text): copied as is
            j = i + 1
            while j < n and ebnf[j] != '"':
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i : j + 1])
            i = j + 1
        elif ch == "[":
            j = i + 1
            while j < n and ebnf[j] != "]":
                j += 2 if ebnf[j] == "\\" else 1
            body = ebnf[i + 1 : j]
            if body.startswith("^"):
                out.append(f"[{body}{_EXCLUSION}]")
            else:
                out.append(f"[{_positive_class(body)}]")
            i = j + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


# A positive class whose first member is an escaped '^' (``[\^x]``): xgrammar 0.2.8
# prints it as ``[^x]``, a negated class, so its printed grammar cannot be re-parsed
# faithfully. Found by comparing every class form against its re-parsed print.
_LEADING_ESCAPED_CARET = re.compile(r"(?<!\\)(?:\\\\)*\[\\\^")


def unfaithful_print(text: str) -> str | None:
    """Why xgrammar's printed form of a grammar written as ``text`` would not mean the same; None if it would."""
    m = _LEADING_ESCAPED_CARET.search(text)
    if m is None:
        return None
    return (
        f"a character class starting with an escaped '^' (offset {m.end() - 3}) is not supported by the grammar "
        "engine's printer (it reads back as a negated class); put the '^' later in the class, e.g. [x\\^]"
    )


def compile_scalar_only(compiler: Any, grammar: Any, repair: Callable[[str], str] | None = None) -> Any:
    """Compile an xgrammar ``Grammar`` with every character class limited to Unicode scalar values.

    ``repair``: a further rewrite of the printed text (schema_rewrite.repair_ebnf). The
    grammar object itself is compiled when neither changes anything; otherwise its
    printed text, re-read exactly (``ebnf_escapes``: ``\\xe7ade`` must stay "çade")."""
    printed = str(grammar)
    text = unambiguous_escapes(printed)
    fixed = exclude_surrogates(repair(text) if repair is not None else text)
    if fixed == text:
        return compiler.compile_grammar(grammar)
    reparse_exactly(printed)  # the text carries the same grammar, or the grammar is refused
    return compiler.compile_grammar(fixed)
