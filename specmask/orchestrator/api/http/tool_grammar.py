"""``tool_choice: "auto"``: a grammar of "free text, or tool calls", and its output back to calls.

The model either answers in text or calls tools, and which one is its own choice
(the grammar admits both). A call is written the Hermes way most tool-tuned chat
models were trained on, one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammar (xgrammar EBNF, built with ``xgrammar.Grammar`` union/concat so every
tool's JSON Schema keeps its own rules) is::

    root  ::= text | block ("\\n" block){0, max_calls - 1}
    text  ::= "" | [^<] any*           (free text never starts with "<")
    block ::= "<tool_call>\\n" call "\\n</tool_call>"
    call  ::= {"name": "<tool>", "arguments": <that tool's parameters>} | ...

Text therefore cannot begin like a call, so the first character decides: "<"
opens tool calls (held back when streaming until they are complete and checked),
anything else is text (streamed as it comes). Text may still mention
``<tool_call>`` later on; it is then text, never parsed as a call.

The end check: every call returned is parsed and its arguments validated against
its tool's own schema with the orchestrator's output checker (``jsonschema``, the
caller's original schema), beyond the engine's end check of the EBNF; a call that
fails is an error, never a success.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.errors import MaskError
from specmask.mask_service.grammar.ebnf_escapes import unambiguous_escapes
from specmask.mask_service.grammar.grammar_checks import precheck
from specmask.orchestrator.api.http.errors import ApiError
from specmask.orchestrator.api.http.protocol import ChatMessage, Tool
from specmask.orchestrator.output_check import OutputChecker, OutputCheckError

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
CALL_SEPARATOR = "\n"
# Calls one answer may make when parallel_tool_calls allows several (OpenAI sets no bound;
# a small one keeps the grammar, which repeats the call rule per call, small).
MAX_PARALLEL_CALLS = 4
_NAME_KEY = '{"name": "'
_ARGUMENTS_KEY = '", "arguments": '
_BLOCK_RULE = "tool_call_block"
_TEXT_RULE = "tool_call_free_text"
_BLOCK_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class AutoTools:
    """The tools of one ``auto`` request: their grammar and what a call must satisfy."""

    grammar: GrammarSpec
    params: dict[str, dict[str, Any]]  # tool name -> its parameters schema (the caller's, unchanged)


def _literal(text: str) -> str:
    """An EBNF string literal (JSON escapes are xgrammar's escapes)."""
    return json.dumps(text, ensure_ascii=False)


def auto_tools(tools: list[Tool], parallel: bool) -> AutoTools:
    """The "text or calls" grammar for ``tools``; ``parallel``: up to MAX_PARALLEL_CALLS calls."""
    import xgrammar as xgr

    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError.invalid("tool function names must be unique", param="tools")
    params: dict[str, dict[str, Any]] = {}
    calls = []
    for tool in tools:
        name = tool.function.name
        schema = dict(tool.function.parameters) if tool.function.parameters is not None else {"type": "object"}
        params[name] = schema
        try:
            # The mask service's own checks of a JSON Schema (metaschema, depth, code points), so a
            # tool refused under "required" is refused under "auto" too, with the same message.
            precheck(GrammarSpec(kind=GrammarKind.JSON_SCHEMA, text=json.dumps(schema)))
        except MaskError as exc:
            raise ApiError.invalid(f"tool {name!r}: {exc}", param="tools") from None
        try:
            args = xgr.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(", ", ": "), strict_mode=True
            )
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ApiError.invalid(
                f"tool {name!r}: its parameters are not a usable JSON Schema: {exc}", param="tools"
            ) from None
        head = xgr.Grammar.from_ebnf(f"root ::= {_literal(_NAME_KEY + name + _ARGUMENTS_KEY)}")
        calls.append(xgr.Grammar.concat(head, args, xgr.Grammar.from_ebnf('root ::= "}"')))
    call = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    block = xgr.Grammar.concat(
        xgr.Grammar.from_ebnf(f"root ::= {_literal(CALL_OPEN)}"),
        call,
        xgr.Grammar.from_ebnf(f"root ::= {_literal(CALL_CLOSE)}"),
    )
    # The block's printed grammar names it ``root`` on its first line and nowhere else (concat
    # made it the top): renamed, it is repeated by reference instead of copied per call.
    # Written so it reads back as printed: "\xe7ade" (the printer's "çade") would read as U+E7ADE.
    printed = unambiguous_escapes(str(block))
    taken = set(re.findall(r"^([A-Za-z0-9_]+) ::=", printed, re.MULTILINE))
    if not printed.startswith("root ::= ") or {_BLOCK_RULE, _TEXT_RULE} & taken:
        raise RuntimeError("unexpected printed tool-call grammar")  # an xgrammar change, not a client error
    more = f" ({_literal(CALL_SEPARATOR)} {_BLOCK_RULE}){{0, {MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
    text = "\n".join(
        [
            f"root ::= {_TEXT_RULE} | {_BLOCK_RULE}{more}",
            f'{_TEXT_RULE} ::= "" | [^<] [^]*',
            _BLOCK_RULE + printed.removeprefix("root"),
        ]
    )
    xgr.Grammar.from_ebnf(text)  # parses (the mask service and the end check parse it again)
    return AutoTools(GrammarSpec(kind=GrammarKind.EBNF, text=text), params)


def is_call_output(text: str) -> bool:
    """Whether (the start of) an output is tool calls rather than text: text never starts with "<"."""
    return text.startswith("<")


class StreamSplit:
    """Which streamed text is held back (tool calls, sent whole once complete and checked) and
    which is sent as it comes (text). With ``auto`` the answer's first text decides, once: text
    never starts with "<", and text that mentions "<" later stays text."""

    def __init__(self, tool_call: bool, auto: bool) -> None:
        self.calls: bool = tool_call
        self._undecided = auto

    def holds(self, text: str) -> bool:
        """Whether ``text`` (a non-empty delta) is held back."""
        if self._undecided:
            self.calls, self._undecided = is_call_output(text), False
        return self.calls


def parse_calls(text: str, tools: AutoTools, checker: OutputChecker) -> list[dict[str, Any]]:
    """The calls of a complete tool-call output as OpenAI ``tool_calls`` entries.

    Raises ``ValueError`` when the text is not well-formed calls or a call's arguments
    break its tool's schema: with a complete grammar that is a broken output, which
    the caller reports as an error.
    """
    blocks = _BLOCK_RE.findall(text)
    rebuilt = CALL_SEPARATOR.join(CALL_OPEN + b + CALL_CLOSE for b in blocks)
    if not blocks or rebuilt != text:
        raise ValueError(f"not a sequence of tool-call blocks: {text[:200]!r}")
    out = []
    for block in blocks:
        call = json.loads(block)
        if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
            raise ValueError(f"not a tool call object: {block[:200]!r}")
        name = call["name"]
        if name not in tools.params:
            raise ValueError(f"a call names {name!r}, which is not in tools")
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        spec = GrammarSpec(kind=GrammarKind.JSON_SCHEMA, text=json.dumps(tools.params[name]))
        try:
            verdict = checker.check(spec, arguments, "xgrammar")
        except OutputCheckError as exc:
            raise ValueError(f"the arguments of {name!r} could not be checked: {exc}") from None
        if not verdict.ok:
            raise ValueError(f"the arguments of {name!r} break its parameters schema: {verdict.reason}")
        out.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return out


def tools_prompt(tools: list[Tool]) -> str:
    """System text for templates that cannot render tools: the tools and the call format."""
    lines = [
        "Answer in plain text, or call tools, one block per call:",
        f'{CALL_OPEN}{{"name": <tool>, "arguments": <object>}}{CALL_CLOSE}',
        "Tools:",
    ]
    for tool in tools:
        fn = tool.function
        params = json.dumps(fn.parameters or {"type": "object"}, separators=(",", ":"), ensure_ascii=False)
        lines.append(f"- {fn.name}: {fn.description or ''} parameters: {params}")
    return "\n".join(lines)


def with_system_text(messages: list[ChatMessage], text: str) -> list[ChatMessage]:
    """``text`` first in the system turn: merged into a leading system message (many templates
    take one only), else a new one."""
    if messages and messages[0].role in ("system", "developer"):
        first = messages[0]
        merged = text + ("\n\n" + first.text if first.text else "")
        return [first.model_copy(update={"content": merged}), *messages[1:]]
    return [ChatMessage(role="system", content=text), *messages]
