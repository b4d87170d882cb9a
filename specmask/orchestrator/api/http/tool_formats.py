"""Tool-call formats: how each model family writes a call, in one registry.

A model writes its tool calls the way its chat template shows past calls (and the way it
was trained): Qwen3 and Hermes models wrap JSON in ``<tool_call>`` tags, Llama 3.1+
writes a bare ``{"name": ..., "parameters": ...}`` object, Mistral a ``[TOOL_CALLS]``
list, gpt-oss a harmony ``commentary`` message. Each format here is data, not code:
the literal text around each call's JSON (the name is part of the literal, so the
grammar pins it), the separator between parallel calls, and the markers that
identify it in a chat template. The strings are the ones of xgrammar's
``get_model_structural_tag`` (llama, qwen_3, harmony) and of the published Mistral
template; ``tool_grammar`` builds the grammar from them and parses the output back.

A marker that the served vocabulary holds as a special token (Mistral's ``[TOOL_CALLS]``,
harmony's ``<|channel|>``, ``<|constrain|>``, ``<|message|>``, ``<|call|>``: a format's
``special_markers``; Llama's optional ``<|python_tag|>``, ``special_open``) is admitted
as that token, by id, as the model writes it; the output's text keeps exactly the tokens
its grammar names, as their text (orchestrator/kept_tokens.py), so the parser reads
the same text either way, and the end check accepts each such token only where the
grammar names it. A vocabulary without the token gets the marker's text in ordinary
tokens.

``auto`` detection (``--tool-call-parser auto``) reads the chat template's text for
each format's markers, in registry order; a template with none of them (or no
template) gets Hermes, the format ``tool_grammar.tools_prompt`` describes to a model
whose template cannot render tools.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass
from enum import StrEnum

NAME = "{name}"  # where a call's literal text carries the tool's name


class ToolCallParser(StrEnum):
    """The values of ``--tool-call-parser`` (vLLM's names where vLLM has the format)."""

    AUTO = "auto"
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    HARMONY = "openai"


@dataclass(frozen=True)
class ToolCallFormat:
    """One family's call syntax. A complete tool-call output is::

        calls_open call (separator call)* calls_close
        call = head(name) <arguments JSON> tail

    ``head`` holds ``{name}`` once (the name is written as JSON string content).
    ``text_open``: what a plain-text answer starts with (harmony's final channel), "" for
    most. ``triggers``: text that, written in a plain-text answer, a parser of this format
    would take for a call (the text branch of any grammar never contains one).
    ``text_never_starts``: characters a text answer may not start with (after whitespace)
    because this format's parser reads an output starting so as a call (vLLM's Llama
    parsers: any output starting with ``{``); every other call start is a trigger, which
    text never holds anywhere. ``text_before_calls``: whether text may come before the
    calls in one answer, its parser splitting it off into ``content`` (vLLM's Hermes and
    Mistral parsers do; its Llama parser reads a call only at the start).
    ``special_open``: a special token the model may write before its calls (Llama's
    ``<|python_tag|>``): where the served vocabulary has it as a special token the grammar
    admits that token, by id, there, and the parser reads the calls after it (the text
    holds it: kept_tokens.py); the client never gets it.
    ``special_markers``: the format's markers that a vocabulary may hold as special tokens:
    where it does, the grammar admits the token (by id) wherever the marker is written.
    ``parallel``: whether several calls may follow one another in one answer.
    """

    parser: ToolCallParser
    calls_open: str
    head: str
    tail: str
    separator: str
    calls_close: str
    markers: tuple[str, ...]  # in a chat template: any of them identifies the format
    triggers: tuple[str, ...]
    text_open: str = ""
    text_never_starts: str = ""
    text_before_calls: bool = False
    special_open: str = ""
    special_markers: tuple[str, ...] = ()
    parallel: bool = True
    # Call ids the template takes back in later turns: Mistral's refuses any but 9 alphanumerics.
    call_id_length: int = 0  # 0: OpenAI-style "call_" + 24 hex digits

    def __post_init__(self) -> None:
        if self.text_before_calls and self.text_open:
            # Text before calls is read up to the first call_start: it has no opening of its own.
            raise ValueError(f"{self.parser.value}: text before calls needs an empty text_open")

    def call_head(self, name: str) -> str:
        """The literal before a call's arguments (``name`` as JSON string content)."""
        return self.head.replace(NAME, json.dumps(name, ensure_ascii=False)[1:-1])

    def call_id(self) -> str:
        """A fresh id for one call, in the shape the format's template accepts back."""
        if self.call_id_length:
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(self.call_id_length))
        return f"call_{uuid.uuid4().hex[:24]}"

    @property
    def call_start(self) -> str:
        """What every tool-call output starts with, whichever tool it names."""
        return self.calls_open + self.head.split(NAME, 1)[0]


HERMES = ToolCallFormat(
    parser=ToolCallParser.HERMES,
    calls_open="",
    head='<tool_call>\n{"name": "' + NAME + '", "arguments": ',
    tail="}\n</tool_call>",
    separator="\n",
    calls_close="",
    markers=("<tool_call>",),
    triggers=("<tool_call>",),
    text_before_calls=True,  # "Let me check.<tool_call>...", as Qwen3 and Hermes models write
)
LLAMA3_JSON = ToolCallFormat(
    parser=ToolCallParser.LLAMA3_JSON,
    calls_open="",
    head='{"name": "' + NAME + '", "parameters": ',
    tail="}",
    separator="; ",  # vLLM's llama3_json parser splits parallel calls on "; "
    calls_close="",
    markers=("<|python_tag|>", '"parameters"'),
    triggers=('{"name"', "<|python_tag|>"),
    text_never_starts="{",
    special_open="<|python_tag|>",  # vLLM's llama3_json parser reads calls after it too
)
MISTRAL = ToolCallFormat(
    parser=ToolCallParser.MISTRAL,
    calls_open="[TOOL_CALLS] [",
    head='{"name": "' + NAME + '", "arguments": ',
    tail="}",
    separator=", ",
    calls_close="]",
    markers=("[TOOL_CALLS]",),
    triggers=("[TOOL_CALLS]",),
    text_before_calls=True,
    special_markers=("[TOOL_CALLS]",),
    call_id_length=9,
)
HARMONY = ToolCallFormat(
    parser=ToolCallParser.HARMONY,
    calls_open="",
    head="<|channel|>commentary to=functions." + NAME + "<|constrain|>json<|message|>",
    tail="<|call|>",
    separator="",
    calls_close="",
    markers=("<|channel|>", "<|call|>"),
    triggers=("<|channel|>", "<|call|>", "<|start|>"),
    text_open="<|channel|>final<|message|>",
    special_markers=("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"),
    parallel=False,  # harmony ends the turn at <|call|>: one call per assistant turn
)

# Detection order: the more specific markers first (a harmony template mentions none of
# the others; a Mistral template may quote "parameters").
FORMATS: dict[ToolCallParser, ToolCallFormat] = {f.parser: f for f in (HARMONY, MISTRAL, HERMES, LLAMA3_JSON)}
# Calls in formats this server does not write, which no plain-text answer may hide either.
FOREIGN_TRIGGERS = ("<｜tool▁calls▁begin｜>", "<|tool_calls_section_begin|>")


# What the text branch of a grammar never contains: every trigger holds one of them, so text
# without them holds no trigger. Shorter than the triggers themselves (the "<|" of every
# special-token marker) because the grammar has one rule per prefix of these, and compiling
# it costs about that many passes over the vocabulary.
TEXT_EXCLUSIONS = ("<|", "<｜", "<tool_call>", '{"name"', "[TOOL_CALLS]")


def all_triggers() -> tuple[str, ...]:
    """Every text a parser of some format reads as a call (each holds a TEXT_EXCLUSIONS entry)."""
    out: dict[str, None] = {}
    for fmt in FORMATS.values():
        out.update(dict.fromkeys(fmt.triggers))
    out.update(dict.fromkeys(FOREIGN_TRIGGERS))
    return tuple(out)


def detect(template: str | None) -> ToolCallFormat:
    """The format a chat template shows calls in; Hermes when it shows none (see module doc)."""
    if template:
        for fmt in FORMATS.values():
            if any(marker in template for marker in fmt.markers):
                return fmt
    return HERMES


def resolve(parser: ToolCallParser | str, template: str | None) -> ToolCallFormat:
    """``--tool-call-parser``: a named format, or ``auto`` (read from the template)."""
    parser = ToolCallParser(parser)
    return detect(template) if parser is ToolCallParser.AUTO else FORMATS[parser]
