"""Chat prompts: messages (+ the JSON Schema instruction) -> the model's own chat template -> text.

One module for the gRPC ``Generate`` path (``GenerateRequest.chat``) and any
other front end: validation of roles and sizes, the default JSON Schema
instruction (JSONSchemaBench-style: the schema goes into the prompt, so the
model knows which document the grammar will hold it to), and rendering with
the template renderer of ``orchestrator.api.http.prompting`` (a sandboxed Jinja
rendering of the model's ``chat_template``, as ``apply_chat_template`` does;
a plain ``role: content`` transcript for models without one). The rendered
text is then tokenized like a text prompt; the template's special tokens are
added tokens of the tokenizer, so they come out as their single ids.

The schema instruction is opt-in: a server started with ``--schema-instruction``
adds it to every JSON Schema chat, a request adds it with ``schema_instruction``
(``"default"`` or its own text). Off by default, the caller's conversation is the
prompt, as with OpenAI and vLLM: a model that copies the instruction's schema
back (``{"type": "object"}`` for JSON mode) or a long schema pushing the prompt
past the context are the server's doing, not the caller's. Text the server adds
never gets a request refused either: when the instruction would not fit the
context, the validator renders the conversation without it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.schema_instruction import DEFAULT_SCHEMA_INSTRUCTION, schema_instruction

# Roles chat templates are expected to understand (OpenAI / HF convention).
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_MESSAGES = 1024
# Bound on the conversation's text before rendering (the token length is checked after).
MAX_CHAT_CHARS = 1 << 20
# ``ChatPrompt.schema_instruction`` value that names DEFAULT_SCHEMA_INSTRUCTION.
DEFAULT_INSTRUCTION_NAME = "default"
# chat_template_kwargs keys that are apply_chat_template's own arguments, not template variables:
# a request may not re-render the conversation, the tools or the prompt's shape through them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatError(ValueError):
    """The conversation cannot be rendered (bad role, empty, too large, refused by the template)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt, before rendering."""

    messages: tuple[ChatMessage, ...]
    # JSON Schema requests: None = the server's default (ChatRenderer), "" = no instruction,
    # "default" = DEFAULT_SCHEMA_INSTRUCTION, else this text ("{schema}" substituted).
    schema_instruction: str | None = None
    # Extra variables for the chat template (vLLM's chat_template_kwargs); None = none.
    template_kwargs: dict[str, Any] | None = None


def reserved_template_kwarg(kwargs: Mapping[str, Any]) -> str | None:
    """The first key of ``kwargs`` that is the renderer's own argument (None: none is)."""
    return next((key for key in kwargs if key in RESERVED_TEMPLATE_KWARGS), None)


def template_kwargs_from_json(text: str) -> dict[str, Any] | None:
    """A chat's template variables sent as a JSON object's text ("" = none); ChatError names
    what is wrong."""
    if not text:
        return None
    if len(text) > MAX_CHAT_CHARS:
        raise ChatError(f"chat_template_kwargs holds {len(text)} characters, more than {MAX_CHAT_CHARS}")
    try:
        kwargs = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ChatError(f"chat_template_kwargs is not JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ChatError("chat_template_kwargs must be a JSON object")
    reserved = reserved_template_kwarg(kwargs)
    if reserved is not None:
        raise ChatError(
            f"chat_template_kwargs.{reserved} is an argument of the template renderer, not a template "
            "variable; it cannot be set per request"
        )
    return kwargs or None


def validate_messages(messages: Sequence[ChatMessage]) -> None:
    if not messages:
        raise ChatError("chat has no messages")
    if len(messages) > MAX_MESSAGES:
        raise ChatError(f"chat has {len(messages)} messages, more than {MAX_MESSAGES}")
    total = 0
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ChatError(f"chat.messages[{i}].role must be one of {sorted(ROLES)}, got {m.role[:32]!r}")
        total += len(m.content)
    if total > MAX_CHAT_CHARS:
        raise ChatError(f"chat messages hold {total} characters, more than {MAX_CHAT_CHARS}")


def with_schema_instruction(
    messages: Sequence[ChatMessage], schema_json: str, template: str | None = None
) -> list[ChatMessage]:
    """Put the schema instruction first, merged into a leading system message if there is one
    (many templates accept a single system message only)."""
    instruction = schema_instruction(schema_json, template)
    if not instruction:
        return list(messages)
    if messages and messages[0].role == "system":
        return [ChatMessage("system", instruction + "\n\n" + messages[0].content), *messages[1:]]
    return [ChatMessage("system", instruction), *messages]


class ChatRenderer:
    """Renders ``ChatPrompt``s with one model's chat template (loaded once, at start-up)."""

    def __init__(self, prompter: Any, default_instruction: str = "") -> None:
        self._prompter = prompter  # orchestrator.api.http.prompting.ChatPrompter
        # What a JSON Schema chat that names no instruction gets: "" = none (the default).
        self._default_instruction = default_instruction

    @property
    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads (a reasoning parser's thinking switch acts only there)."""
        return frozenset(getattr(self._prompter, "template_variables", frozenset()))

    @classmethod
    def for_model(cls, model_dir: str, default_instruction: str = "") -> ChatRenderer:
        from specmask.orchestrator.api.http.prompting import load_prompter

        return cls(load_prompter(model_dir), default_instruction)

    def instruction_template(self, chat: ChatPrompt, grammar: GrammarSpec | None) -> str:
        """The instruction template this chat gets ("" = none): JSON Schema grammars only."""
        if grammar is None or grammar.kind is not GrammarKind.JSON_SCHEMA:
            return ""
        template = self._default_instruction if chat.schema_instruction is None else chat.schema_instruction
        return DEFAULT_SCHEMA_INSTRUCTION if template == DEFAULT_INSTRUCTION_NAME else template

    def messages_for(
        self, chat: ChatPrompt, grammar: GrammarSpec | None, *, instruction: bool = True
    ) -> list[ChatMessage]:
        """The conversation as rendered: with the schema instruction when there is one and
        ``instruction`` is set (False: the caller's messages alone)."""
        validate_messages(chat.messages)
        template = self.instruction_template(chat, grammar) if instruction else ""
        if template and grammar is not None:
            return with_schema_instruction(chat.messages, grammar.text, template)
        return list(chat.messages)

    def render(self, chat: ChatPrompt, grammar: GrammarSpec | None, *, instruction: bool = True) -> str:
        from specmask.orchestrator.api.http.errors import ApiError
        from specmask.orchestrator.api.http.protocol import ChatMessage as ApiChatMessage

        turns = self.messages_for(chat, grammar, instruction=instruction)
        messages = [ApiChatMessage.model_validate({"role": m.role, "content": m.content}) for m in turns]
        try:
            return self._prompter.render(messages, None, chat.template_kwargs)
        except ApiError as exc:  # the template's raise_exception (e.g. roles must alternate)
            raise ChatError(str(exc)) from None
