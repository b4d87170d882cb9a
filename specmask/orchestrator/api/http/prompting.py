"""Chat messages -> one prompt string.

With a chat template (``chat_template`` in the model's tokenizer_config.json,
or a ``chat_template.jinja`` file beside it) the messages are rendered by the
tokenizer's own ``apply_chat_template`` (transformers), with ``tools``,
``add_generation_prompt=True`` and the request's extra template variables
(vLLM's ``chat_template_kwargs``), exactly as the model's authors render them.

Without one (the toy models have none) the fallback is a plain transcript,
one ``<role>: <content>`` block per message and a final ``assistant:`` line to
complete. It is documented (README) and deterministic; a model not trained on
it will follow it loosely, which matters little when a grammar constrains the
answer. It has no variables: extra template variables change nothing there, as
they change nothing in a template that does not read them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

from specmask.common.eos_tokens import configured_eos_ids
from specmask.orchestrator.api.http.errors import ApiError
from specmask.orchestrator.api.http.protocol import ChatMessage, Tool
from specmask.orchestrator.api.http.tool_formats import HERMES, ToolCallFormat, ToolCallParser, resolve
from specmask.orchestrator.api.http.tool_grammar import tools_prompt

logger = logging.getLogger(__name__)


class ChatPrompter(Protocol):
    # Whether ``render`` puts ``tools`` into the prompt in the model's own format.
    supports_tools: bool
    # The variables the template reads (a reasoning parser's thinking switch only acts where read).
    template_variables: frozenset[str]
    # The format the model writes tool calls in (tool_formats; ``--tool-call-parser``).
    tool_format: ToolCallFormat
    # The vocabulary's special tokens, text -> id (a tool format's markers are admitted by id).
    special_tokens: Mapping[str, int]
    # The model's end-of-sequence tokens (its config files'): a marker that is one ends the
    # output instead of being written in it (gpt-oss's <|call|>; tool_grammar).
    stop_token_ids: frozenset[int]

    def render(
        self, messages: list[ChatMessage], tools: list[Tool] | None, template_kwargs: Mapping[str, Any] | None = None
    ) -> str: ...


def _message_dict(msg: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": msg.role, "content": msg.text}
    if msg.name:
        out["name"] = msg.name
    if msg.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
            }
            for c in msg.tool_calls
        ]
    if msg.tool_call_id:
        out["tool_call_id"] = msg.tool_call_id
    return out


def _arguments(text: str) -> Any:
    # Templates index arguments as a mapping (HF convention); keep the text if it is not JSON.
    try:
        return json.loads(text)
    except ValueError:
        return text


class TranscriptPrompter:
    """The fallback: ``role: content`` blocks, then ``assistant:``."""

    supports_tools = False
    template_variables: frozenset[str] = frozenset()
    tool_format = HERMES
    special_tokens: Mapping[str, int] = {}  # no tokenizer is loaded for the transcript
    stop_token_ids: frozenset[int] = frozenset()

    def render(
        self, messages: list[ChatMessage], tools: list[Tool] | None, template_kwargs: Mapping[str, Any] | None = None
    ) -> str:
        blocks = []
        if tools:
            blocks.append(f"system: {tools_prompt(tools, self.tool_format)}")
        for msg in messages:
            text = msg.text
            if msg.tool_calls:
                calls = [
                    {"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in msg.tool_calls
                ]
                text = (text + "\n" if text else "") + json.dumps(calls)
            blocks.append(f"{msg.role}: {text}")
        blocks.append("assistant:")
        return "\n".join(blocks)


class TemplatePrompter:
    """The model's chat template, rendered by its tokenizer's ``apply_chat_template``.

    Hugging Face's own renderer, not a copy of it: the template sees exactly the globals,
    filters and extensions it was written against (``raise_exception``, ``strftime_now``,
    ``tojson`` options, loop controls), and ``tools`` reach templates that read them.
    """

    def __init__(
        self,
        tokenizer: Any,
        tool_call_parser: ToolCallParser = ToolCallParser.AUTO,
        stop_token_ids: Collection[int] = (),
    ) -> None:  # tokenizer: transformers.PreTrainedTokenizerBase
        """``stop_token_ids``: the model's end-of-sequence tokens (``load_prompter`` reads them from
        the model's config files)."""
        self._tokenizer = tokenizer
        self.stop_token_ids = frozenset(int(i) for i in stop_token_ids)
        self.special_tokens: Mapping[str, int] = {
            str(t.content): int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special
        }
        template = tokenizer.chat_template
        texts = template.values() if isinstance(template, dict) else [template]
        self.tool_format = resolve(tool_call_parser, "\n".join(texts))
        self.template_variables = frozenset(
            v for t in (template.values() if isinstance(template, dict) else [template]) for v in _variables(t)
        )
        # A template that never reads ``tools`` would drop them silently.
        self.supports_tools = any(
            _reads_tools(t) for t in (template.values() if isinstance(template, dict) else [template])
        )

    def render(
        self, messages: list[ChatMessage], tools: list[Tool] | None, template_kwargs: Mapping[str, Any] | None = None
    ) -> str:
        """``template_kwargs``: extra template variables (their names are checked by the caller:
        none of apply_chat_template's own arguments)."""
        from jinja2.exceptions import TemplateError

        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        try:
            text = self._tokenizer.apply_chat_template(
                [_message_dict(m) for m in messages],
                tools=tool_dicts,
                add_generation_prompt=True,
                tokenize=False,
                **dict(template_kwargs or {}),
            )
        except TemplateError as exc:  # e.g. the template's raise_exception("roles must alternate")
            raise ApiError.invalid(f"the model's chat template refused the messages: {exc}", param="messages") from exc
        return str(text)


def _variables(template: str) -> set[str]:
    from jinja2 import Environment, meta

    return meta.find_undeclared_variables(Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template))


def _reads_tools(template: str) -> bool:
    from jinja2 import Environment, meta

    return "tools" in meta.find_undeclared_variables(
        Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    )


def load_prompter(model_dir: str, tool_call_parser: ToolCallParser = ToolCallParser.AUTO) -> ChatPrompter:
    """The model's chat template (``chat_template`` in tokenizer_config.json or a
    ``chat_template.jinja`` beside it) if it ships one, else the transcript fallback.
    ``tool_call_parser``: the tool-call format (``auto``: read from the template).

    A directory whose template is there but whose tokenizer transformers cannot load is a
    start-up error, not a silent fall back to a prompt format the model was not trained on.
    """
    path = Path(model_dir)
    config_path = path / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if not config.get("chat_template") and not (path / "chat_template.jinja").is_file():
        logger.info("%s has no chat template: chat prompts use the plain transcript format", model_dir)
        transcript = TranscriptPrompter()
        transcript.tool_format = resolve(tool_call_parser, None)
        return transcript
    # Imported here, not at module level: the orchestrator's modules import without model
    # libraries (tests/test_import_hygiene.py); transformers loads a tokenizer without torch.
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"{model_dir} has a chat template but its tokenizer does not load: {exc}") from exc
    if not tokenizer.chat_template:
        raise RuntimeError(f"{model_dir} has a chat template that transformers does not read")
    stops = configured_eos_ids(path, tokenizer.convert_tokens_to_ids)
    prompter = TemplatePrompter(tokenizer, tool_call_parser, stops)
    logger.info("tool calls in the %s format", prompter.tool_format.parser.value)
    return prompter
