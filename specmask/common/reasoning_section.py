"""The free reasoning section a reasoning model writes before its answer (no engine imports).

A reasoning model (Qwen3, DeepSeek-R1 and its distills) thinks first and answers
after: ``<think>`` free text ``</think>``, a blank line, then the answer. Under a
grammar the answer is the caller's: the whole output is governed by one grammar,
``section caller_grammar``, where the section is ``open``, any text that does not
contain ``close``, ``close`` and ``gap``. The mask service compiles that one grammar
(``mask_service/grammar/sections.py``), so drafts, draft masks and the verifier see
one grammar state at every position, across the boundary too.

The section is a constant of the reasoning parser (``orchestrator/reasoning.py``),
never caller text. Its split of an output (``split_output``) is unambiguous: the
section ends at the first ``close`` (the body cannot hold it) and ``gap`` follows
it exactly, so what the caller's grammar governed, the *content*, is exactly the
text after ``close + gap``. The end check checks that, and only that.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningSection:
    """``open`` (may be "": the model starts inside the section, as DeepSeek-R1's template
    leaves it), a body free of ``close``, ``close``, then exactly ``gap``."""

    open: str
    close: str
    gap: str = ""
    # A request's budget: after this many tokens in the section, only its end may follow
    # (mask_service/grammar/section_budget.py); 0 = unbounded.
    max_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.max_tokens < 1 << 32:  # a uint32 on the wire
            raise ValueError(f"max_tokens must be in [0, 2**32) (0 = unbounded), got {self.max_tokens}")
        if not self.close:
            raise ValueError("a reasoning section needs a closing tag")
        # The grammar of "text without close" (sections.py) is built from close's first
        # character; it is exact only when that character occurs nowhere else in close.
        if self.close[0] in self.close[1:]:
            raise ValueError(f"a closing tag must not repeat its first character: {self.close!r}")
        if self.close in self.open:
            raise ValueError("the opening tag must not contain the closing tag")

    def key(self) -> list[str | int]:
        """What the section adds to a grammar's cache key."""
        return [self.open, self.close, self.gap, *([self.max_tokens] if self.max_tokens else [])]


@dataclass(frozen=True)
class SectionSplit:
    """An output read as a section then content.

    ``closed``: the section ended (``close`` then ``gap`` were written); only then is
    ``content`` the text the caller's grammar governed. Unclosed, ``content`` is ""."""

    reasoning: str
    content: str
    closed: bool


def split_output(section: ReasoningSection, text: str) -> SectionSplit | None:
    """The grammar's reading of a whole output; None when ``text`` does not start with the
    opening tag (the output is not of the form the grammar admits)."""
    if not text.startswith(section.open):
        return None
    body_start = len(section.open)
    end = text.find(section.close, body_start)
    if end < 0:
        return SectionSplit(text[body_start:], "", closed=False)
    after = end + len(section.close)
    if not text.startswith(section.gap, after):
        return SectionSplit(text[body_start:end], "", closed=False)
    return SectionSplit(text[body_start:end], text[after + len(section.gap) :], closed=True)
