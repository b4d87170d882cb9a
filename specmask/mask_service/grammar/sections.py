"""A reasoning section composed in front of a caller's grammar, for each engine.

The output is governed by one grammar, ``section caller`` (common/reasoning_section.py):
the section is ``open``, a body that does not contain ``close``, ``close`` and ``gap``.
Both engines get the same language:

* xgrammar: ``Grammar.concat(section, caller)``, the section as EBNF;
* llguidance: the Lark text's ``start`` rule prefixed by the section as one regex
  terminal (its language is prefix-free: no word of it continues another, since the
  body cannot hold ``close``, so the lexer never has to choose where it ends).

"Text without ``close``" is written without complement operators (neither engine's
EBNF has one). With ``c = close[0]``, which occurs nowhere else in ``close``
(``ReasoningSection`` checks it), every occurrence of ``close`` starts at a ``c``.
Cut the body before each ``c``: ``[^c]* (c T)*``, each ``T`` a run free of ``c``.
The body is free of ``close`` exactly when no ``T`` starts with ``close[1:]``, and
the runs that do not are ``( [^c w1] [^c]* | w1 ( [^c w2] [^c]* | w2 ( ... ) )? )?``
for ``close[1:] = w1 w2 ... wn``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.reasoning_section import ReasoningSection
from specmask.mask_service.errors import GrammarError

# Rule names of the section in a composed xgrammar grammar; the caller's grammar keeps its
# own names (Grammar.concat renames clashes).
_ROOT = "reasoning_section"
_BODY = "reasoning_body"
_RUN = "reasoning_run"


def _class_char(ch: str) -> str:
    """One character inside ``[...]``, in a spelling both xgrammar's EBNF and regex syntax read."""
    if ch in "\\]^-[":
        return "\\" + ch
    if ch.isprintable() and not ch.isspace():
        return ch
    return f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}"


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching itself: non-alphanumerics as one-character classes, since
    escapes of punctuation differ between regex dialects (Rust reads ``\\<`` as a word boundary)."""
    return "".join(ch if ch.isalnum() and ch.isascii() else f"[{_class_char(ch)}]" for ch in text)


def _not(*chars: str) -> str:
    return "[^" + "".join(_class_char(c) for c in dict.fromkeys(chars)) + "]"


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _ebnf_run(c: str, rest: str) -> str:
    """EBNF for the runs free of ``c`` that do not start with ``rest`` (module doc)."""
    if not rest:
        raise AssertionError("a one-character close has no runs after it")  # handled by the caller
    out = f"( {_not(c, rest[-1])} {_not(c)}* )?"
    for i in range(len(rest) - 2, -1, -1):
        out = f"( {_not(c, rest[i])} {_not(c)}* | {_ebnf_literal(rest[i])} {out} )?"
    return out


def section_ebnf(section: ReasoningSection) -> str:
    """xgrammar EBNF (root ``reasoning_section``) for the section alone."""
    c, rest = section.close[0], section.close[1:]
    head = " ".join(_ebnf_literal(t) for t in (section.open,) if t)
    tail = " ".join(_ebnf_literal(t) for t in (section.close, section.gap) if t)
    lines = [f"root ::= {_ROOT}", f"{_ROOT} ::= {head} {_BODY} {tail}".replace("  ", " ")]
    if rest:
        lines.append(f"{_BODY} ::= {_not(c)}* ( {_ebnf_literal(c)} {_RUN} )*")
        lines.append(f"{_RUN} ::= {_ebnf_run(c, rest)}")
    else:
        lines.append(f"{_BODY} ::= {_not(c)}*")
    return "\n".join(lines)


def section_regex(section: ReasoningSection) -> str:
    """The section as one regex (the syntax llguidance's Lark terminals and Rust's regex read)."""
    c, rest = section.close[0], section.close[1:]
    body = f"{_not(c)}*"
    if rest:
        run = f"(?:{_not(c, rest[-1])}{_not(c)}*)?"
        for i in range(len(rest) - 2, -1, -1):
            run = f"(?:{_not(c, rest[i])}{_not(c)}*|{_regex_literal(rest[i])}{run})?"
        body += f"(?:{_regex_literal(c)}{run})*"
    return _regex_literal(section.open) + body + _regex_literal(section.close) + _regex_literal(section.gap)


def compose_xgrammar(caller: Any, section: ReasoningSection) -> Any:
    """``section caller`` as one xgrammar ``Grammar`` (``caller``: the caller's ``Grammar``)."""
    import xgrammar as xgr

    return xgr.Grammar.concat(xgr.Grammar.from_ebnf(section_ebnf(section)), caller)


# The llguidance kinds whose Lark text this module writes itself (backends_llguidance): one
# ``start:`` line it can prefix. A caller's own Lark text is not rewritten (its ``start``
# may be spread over alternatives and lines); such a grammar composes through xgrammar.
LLGUIDANCE_KINDS = frozenset({GrammarKind.JSON_SCHEMA, GrammarKind.ANY_JSON, GrammarKind.REGEX})
_START = re.compile(r"^start: ", re.MULTILINE)


def compose_llguidance(lark: str, spec: GrammarSpec) -> str:
    """The llguidance Lark text ``lark`` of ``spec`` with the section in front of its ``start``."""
    section = spec.reasoning
    if section is None:
        return lark
    if spec.kind not in LLGUIDANCE_KINDS or len(_START.findall(lark)) != 1:
        raise GrammarError(
            f"a reasoning section composes with a {spec.kind.value} grammar through xgrammar only; "
            "use guided_decoding_backend auto or xgrammar"
        )
    terminal = "REASONING_SECTION"
    body = section_regex(section).replace("/", "\\/")  # inside /.../ only '/' ends the literal
    return _START.sub(f"start: {terminal} ", lark) + f"{terminal}: /{body}/\n"
