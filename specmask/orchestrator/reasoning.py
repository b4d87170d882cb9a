"""Reasoning parsers (vLLM's ``--reasoning-parser``): where a model's thinking ends and its answer starts.

A parser names the model family's reasoning format: a ``ReasoningSection``
(common/reasoning_section.py) that opens the output. Under a grammar the section
is composed in front of the caller's grammar by the mask service, so the model
thinks freely and the grammar applies from the end of the section; the end check
checks only the content after it (output_check). The answer is returned as
``content``, the thinking apart as ``reasoning`` (vLLM's current name) and
``reasoning_content`` (its former one, which DeepSeek's API and many clients read).

* ``qwen3``: ``<think>`` thinking ``</think>`` then a blank line. Qwen3's template
  leaves the generation prompt open and the model writes ``<think>`` itself; its
  ``enable_thinking: false`` (``chat_template_kwargs``) writes an empty section into
  the prompt instead, and then no section is expected.
* ``deepseek_r1``: thinking ``</think>`` then a blank line; the model may or may not
  write ``<think>`` first (newer templates put it in the prompt), and a leading
  ``<think>`` is not part of the reasoning. Its templates have no thinking switch.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specmask.common.reasoning_section import ReasoningSection
from specmask.orchestrator.types import GenerationRequest


class ReasoningParser(enum.Enum):
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"


@dataclass(frozen=True)
class ReasoningFormat:
    section: ReasoningSection
    # The template variable whose ``false`` renders thinking off into the prompt ("" = none).
    switch: str = ""
    # Text the model may write at the start of the body that is a tag, not reasoning.
    skip: str = ""


FORMATS: Mapping[ReasoningParser, ReasoningFormat] = {
    ReasoningParser.QWEN3: ReasoningFormat(ReasoningSection("<think>", "</think>", "\n\n"), switch="enable_thinking"),
    ReasoningParser.DEEPSEEK_R1: ReasoningFormat(ReasoningSection("", "</think>", "\n\n"), skip="<think>"),
}


def parse_parser(name: str) -> ReasoningParser | None:
    """``--reasoning-parser`` -> the parser ("" = none); ValueError names the known ones."""
    if not name:
        return None
    try:
        return ReasoningParser(name)
    except ValueError:
        known = ", ".join(p.value for p in ReasoningParser)
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}") from None


def format_for(
    parser: ReasoningParser | None, template_kwargs: Mapping[str, Any] | None, template_variables: frozenset[str]
) -> ReasoningFormat | None:
    """The request's reasoning format, or None: no parser, or thinking switched off.

    Off means the template reads the parser's switch and the request set it to ``false``
    (Qwen3's template tests ``enable_thinking is false``: only the boolean turns it off).
    A template that does not read the switch renders thinking on whatever it is set to,
    so the section stays expected."""
    if parser is None:
        return None
    fmt = FORMATS[parser]
    if fmt.switch and fmt.switch in template_variables and (template_kwargs or {}).get(fmt.switch) is False:
        return None
    return fmt


@dataclass(frozen=True)
class Answer:
    """A whole output as the client sees it. ``content`` is None when the section never closed
    (the model was cut short while thinking: there is no answer)."""

    reasoning: str | None
    content: str | None


def _body_start(fmt: ReasoningFormat, text: str) -> int | None:
    """Where the reasoning starts in ``text``; None while that is still undecided (a prefix of
    the opening tag or of the skipped tag); -1 when the output has no section at all."""
    opening = fmt.section.open
    if not text.startswith(opening):
        return None if opening.startswith(text) else -1
    start = len(opening)
    if fmt.skip:
        rest = text[start:]
        if rest.startswith(fmt.skip):
            return start + len(fmt.skip)
        if fmt.skip.startswith(rest):
            return None
    return start


def split_answer(fmt: ReasoningFormat, text: str) -> Answer:
    """The reasoning and the content of a finished output.

    For a grammar request this is the end check's split (``split_output``): the grammar
    guarantees the gap after the closing tag. Without a grammar the model may skip the
    gap or the whole section; what it wrote is then content."""
    start = _body_start(fmt, text)
    if start is None or start < 0:
        return Answer(None, text)
    close = text.find(fmt.section.close, start)
    if close < 0:
        return Answer(text[start:], None)
    rest = text[close + len(fmt.section.close) :]
    return Answer(text[start:close], rest.removeprefix(fmt.section.gap))


class _Phase(enum.Enum):
    START = "start"  # the opening tag is still undecided
    BODY = "body"
    GAP = "gap"  # after the closing tag, the gap still undecided
    CONTENT = "content"


class ReasoningStream:
    """``split_answer`` for a stream: each delta of text becomes (reasoning, content) deltas.

    Text that may still turn out to be a tag (a prefix of the closing tag at the end of
    what came so far) is held until the next delta decides it, so no tag ever reaches a
    client as reasoning, and the deltas always concatenate to ``split_answer`` of the whole."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._fmt = fmt
        self._held = ""  # text not yet sent
        self._phase = _Phase.START

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning, content = "", ""
        if self._phase is _Phase.START:
            start = _body_start(self._fmt, self._held)
            if start is None:
                return "", ""
            if start < 0:
                self._phase = _Phase.CONTENT
            else:
                self._held = self._held[start:]
                self._phase = _Phase.BODY
        if self._phase is _Phase.BODY:
            close = self._fmt.section.close
            at = self._held.find(close)
            if at < 0:
                keep = _partial_suffix(self._held, close)
                reasoning, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
                return reasoning, ""
            reasoning, self._held = self._held[:at], self._held[at + len(close) :]
            self._phase = _Phase.GAP
        if self._phase is _Phase.GAP:
            gap = self._fmt.section.gap
            if len(self._held) < len(gap) and gap.startswith(self._held):
                return reasoning, ""
            self._held = self._held.removeprefix(gap)
            self._phase = _Phase.CONTENT
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held text at the end of the output: a tag that never completed is what it is."""
        held, self._held = self._held, ""
        if self._phase is _Phase.BODY:
            return held, ""
        if self._phase is _Phase.START:
            return "", held  # fewer characters than the opening tag: no section
        return "", held  # an incomplete gap is content, as split_answer reads it

    @property
    def in_content(self) -> bool:
        return self._phase is _Phase.CONTENT


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# The wire holds a section's budget in 32 bits; no context comes near this many tokens.
MAX_REASONING_TOKENS = (1 << 31) - 1


def with_section(
    request: GenerationRequest, fmt: ReasoningFormat | None, max_tokens: int | None = None
) -> GenerationRequest:
    """``request`` with its grammar behind the format's section (unchanged without a grammar or a
    format). ``max_tokens``: the section's token budget (needs both; ValueError otherwise)."""
    if max_tokens is not None:
        if not 1 <= max_tokens <= MAX_REASONING_TOKENS:
            raise ValueError(f"max_reasoning_tokens must be in [1, {MAX_REASONING_TOKENS}], got {max_tokens}")
        if fmt is None:
            raise ValueError("max_reasoning_tokens needs a reasoning section (--reasoning-parser, thinking on)")
        if request.grammar is None:
            # The budget is enforced by the grammar's mask session; a request without one has none.
            raise ValueError(
                "max_reasoning_tokens needs an output constraint (response_format, tools, "
                "structured_outputs or guided_*)"
            )
    if fmt is None or request.grammar is None:
        return request
    section = dataclasses.replace(fmt.section, max_tokens=max_tokens or 0)
    return dataclasses.replace(request, grammar=dataclasses.replace(request.grammar, reasoning=section))
