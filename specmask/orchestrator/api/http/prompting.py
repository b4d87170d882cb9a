"""Chat messages -> one prompt string.

With a chat template (``chat_template`` in the model's tokenizer_config.json,
or a ``chat_template.jinja`` file beside it) the messages are rendered the way
Hugging Face's ``apply_chat_template`` does: a sandboxed Jinja environment,
``messages``/``tools``/``bos_token``/``eos_token``/``add_generation_prompt=True``.

Without one (the toy models have none) the fallback is a plain transcript,
one ``<role>: <content>`` block per message and a final ``assistant:`` line to
complete. It is documented (README) and deterministic; a model not trained on
it will follow it loosely, which matters little when a grammar constrains the
answer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol

from specmask.orchestrator.api.http.errors import ApiError
from specmask.orchestrator.api.http.protocol import ChatMessage, Tool
from specmask.orchestrator.api.http.tools import describe_tools

logger = logging.getLogger(__name__)


class ChatPrompter(Protocol):
    # Whether ``render`` puts ``tools`` into the prompt in the model's own format.
    supports_tools: bool

    def render(self, messages: list[ChatMessage], tools: list[Tool] | None) -> str: ...


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

    def render(self, messages: list[ChatMessage], tools: list[Tool] | None) -> str:
        blocks = []
        if tools:
            blocks.append(f"system: {describe_tools(tools)}")
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
    """A Hugging Face chat template (Jinja), rendered in a sandbox."""

    def __init__(self, template: str, special: dict[str, str]) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(template)
        self._special = special
        # A template that never reads ``tools`` would drop them silently.
        self.supports_tools = "tools" in template

    def render(self, messages: list[ChatMessage], tools: list[Tool] | None) -> str:
        from jinja2.exceptions import TemplateError

        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        try:
            return self._template.render(
                messages=[_message_dict(m) for m in messages],
                tools=tool_dicts,
                add_generation_prompt=True,
                **self._special,
            )
        except TemplateError as exc:  # e.g. the template's raise_exception("roles must alternate")
            raise ApiError.invalid(f"the model's chat template refused the messages: {exc}", param="messages") from exc


def _special_token(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} (AddedToken serialised)
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def load_prompter(model_dir: str) -> ChatPrompter:
    """The model's chat template if it ships one, else the transcript fallback."""
    path = Path(model_dir)
    config_path = path / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        config = json.loads(config_path.read_text())
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = path / "chat_template.jinja"
    if not template and jinja_file.is_file():
        template = jinja_file.read_text()
    if not template:
        logger.info("%s has no chat template: chat prompts use the plain transcript format", model_dir)
        return TranscriptPrompter()
    special = {name: _special_token(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return TemplatePrompter(template, special)
