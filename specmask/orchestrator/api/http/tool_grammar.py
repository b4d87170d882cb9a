"""Tool calls as a grammar in the model's own format, and the output back to OpenAI ``tool_calls``.

One grammar serves every ``tool_choice`` that calls tools: ``"auto"`` (and tools
without ``tool_choice``) admits plain text or calls (or text then calls, where the
format's parser splits that), ``"required"`` one or more
calls to any tool, a named function one call to that tool. ``parallel_tool_calls:
false`` (or a format with one call per turn) allows one call. The calls are written
in the format of ``tool_formats`` the server serves (``--tool-call-parser``), e.g.
Hermes (Qwen3)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammar (xgrammar EBNF, built with ``xgrammar.Grammar`` union/concat so every
tool's JSON Schema keeps its own rules)::

    root  ::= text | calls                     ("auto"; otherwise root ::= calls)
    root  ::= text | text calls                ("auto" where the format has text before calls)
    calls ::= calls_open call (separator call){0, max_calls - 1} calls_close
    calls ::= (Token(id))? calls_open ...     (a special_open the vocabulary has as a special token)
    call  ::= head("get_weather") <its parameters> tail | ...
    text  ::= text_open body

A marker of the format that the vocabulary holds as a special token (``special_markers``)
is ``Token(id)`` wherever it is written in those literals (``"[TOOL_CALLS]" " ["`` becomes
``Token(id) " ["``): the model writes its own token, and the text keeps it as the marker's
text (orchestrator/kept_tokens.py), so the parsing below reads the same text either way.
A marker that is also one of the model's stop tokens cannot be a ``Token(id)`` of the
grammar (the engine admits a stop token only where the grammar ends): where it is the call's
``tail`` (gpt-oss's ``<|call|>``) the grammar ends after the arguments and the model's stop
token ends the call, as the model writes it; anywhere else it is written out.

``body`` is free text with two exclusions, so a call can never hide in content: it
never contains ``tool_formats.TEXT_EXCLUSIONS`` (``<|``, ``<｜``, ``<tool_call>``,
``{"name"``, ``[TOOL_CALLS]``), one of which is in every call trigger of every known
format, and it does not start (after whitespace) with the format's
``text_never_starts`` (Llama's ``{``: its parsers read any output starting with one as
a call). So the grammar's text is what a vLLM-style parser of any of those formats
reads as text only, and may still start with ``<``, ``{`` or ``[`` wherever the
format's parser would not take that for a call (``<b>`` under Hermes). The exclusion
is a right-linear grammar of the Aho-Corasick automaton of those strings.

Where the calls start is decided by the format's ``call_start``: its first occurrence
is the first call (text never holds the trigger inside it, and no trigger overlaps
itself, so the trigger cannot begin in the text and end in the call); with no text
before calls, an output is calls exactly when it starts with it (``StreamSplit`` holds
back only text that could still be the start of a call). The end check: every call is parsed and its
arguments validated against its tool's own schema with the orchestrator's output
checker (``jsonschema``, the caller's schema), beyond the engine's end check of the
EBNF; a call that fails is an error, never a success.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.errors import MaskError
from specmask.mask_service.grammar.ebnf_escapes import unambiguous_escapes
from specmask.mask_service.grammar.grammar_checks import precheck
from specmask.orchestrator.api.http.errors import ApiError
from specmask.orchestrator.api.http.protocol import ChatMessage, NamedToolChoice, Tool
from specmask.orchestrator.api.http.tool_formats import HERMES, NAME, TEXT_EXCLUSIONS, ToolCallFormat
from specmask.orchestrator.output_check import OutputChecker, OutputCheckError

# Calls one answer may make when parallel_tool_calls allows several (OpenAI sets no bound;
# a small one keeps the grammar, which repeats the call rule per call, small).
MAX_PARALLEL_CALLS = 4
_CALL_RULE = "tool_call_one"
_RULE_PREFIX = "tool_call_"
_LEADING_SPACE = " \t\r\n"


@dataclass(frozen=True)
class ToolGrammar:
    """The tools of one request that may call them: the grammar and what each call must satisfy."""

    grammar: GrammarSpec
    params: dict[str, dict[str, Any]]  # tool name -> its parameters schema (the caller's, unchanged)
    format: ToolCallFormat
    text_allowed: bool  # tool_choice "auto": the answer may be text instead of calls
    max_calls: int
    # Markers the grammar admits as special tokens (text -> id): the text holds them as their
    # text, and no content returned to the client does.
    special: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # What ends each call in the output's text: the format's tail, or "" where the tail is the
    # model's stop token (gpt-oss's <|call|>), which ends the output and is not in its text.
    tail: str | None = None

    @property
    def call_tail(self) -> str:
        return self.format.tail if self.tail is None else self.tail


def _literal(text: str) -> str:
    """An EBNF string literal (JSON escapes are xgrammar's escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _spelled(text: str, special: Mapping[str, int]) -> str:
    """``text`` as an EBNF sequence: its ``special`` markers as ``Token(id)``, the rest literals."""
    parts: list[str] = []
    pos = 0
    while pos < len(text):
        hits = [(text.find(m, pos), m) for m in special if m and text.find(m, pos) >= 0]
        if not hits:
            parts.append(_literal(text[pos:]))
            break
        at, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
        if at > pos:
            parts.append(_literal(text[pos:at]))
        parts.append(f"Token({int(special[marker])})")
        pos = at + len(marker)
    return " ".join(parts) or '""'


def _special_markers(fmt: ToolCallFormat, special_tokens: Mapping[str, int] | None) -> dict[str, int]:
    """The format's markers the vocabulary holds as special tokens (text -> id)."""
    vocab = special_tokens or {}
    return {m: int(vocab[m]) for m in fmt.special_markers if m in vocab}


def _char(ch: str) -> str:
    """One character inside an EBNF character class, escaped whatever it is."""
    code = ord(ch)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def chosen_tools(tools: list[Tool], choice: str | NamedToolChoice | None) -> list[Tool]:
    """The tools a call may name under ``choice`` (not "none"), checked."""
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError.invalid("tool function names must be unique", param="tools")
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise ApiError.invalid(
                f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice"
            )
        return chosen
    if choice not in (None, "auto", "required"):
        raise ApiError.invalid(f"unknown tool_choice {choice!r}", param="tool_choice")
    return tools


def tool_grammar(
    tools: list[Tool],
    choice: str | NamedToolChoice | None,
    parallel: bool,
    fmt: ToolCallFormat = HERMES,
    special_tokens: Mapping[str, int] | None = None,
    stop_tokens: Collection[int] = (),
) -> ToolGrammar:
    """The grammar of ``choice`` over ``tools`` in ``fmt``; ``parallel``: up to MAX_PARALLEL_CALLS calls.
    ``special_tokens``: the served vocabulary's special tokens (text -> id): the format's
    ``special_open`` is admitted by id before the calls, its ``special_markers`` by id where
    they are written. ``stop_tokens``: the model's stop tokens, never admitted by id (see the
    module doc)."""
    import xgrammar as xgr

    vocab = special_tokens or {}
    stops = frozenset(int(i) for i in stop_tokens)
    special = {m: i for m, i in _special_markers(fmt, vocab).items() if i not in stops}
    # The stop token ends the output: the call's tail is not written (and not in the text).
    tail_text = "" if fmt.tail in fmt.special_markers and vocab.get(fmt.tail) in stops else fmt.tail
    # A call the stop token ends is the output's last: one call per answer then.
    several = parallel and fmt.parallel and bool(tail_text) and not isinstance(choice, NamedToolChoice)
    max_calls = MAX_PARALLEL_CALLS if several else 1
    head_before, head_after = fmt.head.split(NAME, 1)

    chosen = chosen_tools(tools, choice)
    text_allowed = choice in (None, "auto")
    params: dict[str, dict[str, Any]] = {}
    calls = []
    for tool in chosen:
        name = tool.function.name
        # No parameters, or {} (any JSON): an object, as OpenAI's arguments always are.
        schema = dict(tool.function.parameters or {}) or {"type": "object"}
        params[name] = schema
        _local_refs_only(schema, name)
        try:
            # The mask service's own checks of a JSON Schema (metaschema, depth, code points): the
            # same refusal, with the same message, as response_format would give.
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
        # The name is the caller's, between the format's own text: never read for markers.
        spelled_name = _literal(json.dumps(name, ensure_ascii=False)[1:-1])
        head = f"{_spelled(head_before, special)} {spelled_name} {_spelled(head_after, special)}"
        parts = [xgr.Grammar.from_ebnf(f"root ::= {head}"), args]
        if tail_text:
            parts.append(xgr.Grammar.from_ebnf(f"root ::= {_spelled(tail_text, special)}"))
        calls.append(xgr.Grammar.concat(*parts))
    call = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    # The call's printed grammar names it ``root`` on its first line and nowhere else (concat
    # made it the top): renamed, it is repeated by reference instead of copied per call.
    # Written so it reads back as printed: "\xe7ade" (the printer's "çade") would read as U+E7ADE.
    printed = unambiguous_escapes(str(call))
    taken = set(re.findall(r"^([A-Za-z0-9_]+) ::=", printed, re.MULTILINE))
    if not printed.startswith("root ::= ") or any(t.startswith(_RULE_PREFIX) for t in taken):
        raise RuntimeError("unexpected printed tool-call grammar")  # an xgrammar change, not a client error
    more = f" ({_spelled(fmt.separator, special)} {_CALL_RULE}){{0, {max_calls - 1}}}" if max_calls > 1 else ""
    calls_rule = f"{_spelled(fmt.calls_open, special)} {_CALL_RULE}{more} {_spelled(fmt.calls_close, special)}"
    opener = vocab.get(fmt.special_open) if fmt.special_open else None
    if opener is not None and opener not in stops:
        # The token, never its text: the text is a trigger no text or call may hold.
        calls_rule = f"(Token({int(opener)}))? {calls_rule}"
        special[fmt.special_open] = int(opener)
    if not text_allowed:
        lines = [f"root ::= {calls_rule}"]
    elif fmt.text_before_calls:
        # One rule for text, calls, and text then calls (an empty text first is the calls alone).
        lines = [f'root ::= {_RULE_PREFIX}text ("" | {_RULE_PREFIX}calls)']
    else:
        lines = [f"root ::= {_RULE_PREFIX}text | {_RULE_PREFIX}calls"]
    if text_allowed:
        lines.append(f"{_RULE_PREFIX}calls ::= {calls_rule}")
        lines += _text_rules(fmt, special)
    lines.append(_CALL_RULE + printed.removeprefix("root"))
    text = "\n".join(lines)
    xgr.Grammar.from_ebnf(text)  # parses (the mask service and the end check parse it again)
    return ToolGrammar(
        GrammarSpec(kind=GrammarKind.EBNF, text=text), params, fmt, text_allowed, max_calls, special, tail_text
    )


def _local_refs_only(node: Any, tool: str) -> None:
    """Refuses a ``$ref`` outside the tool's own parameters: no engine fetches it, and xgrammar
    would read it as "anything" (a dropped constraint, never an answer)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
                raise ApiError.invalid(
                    f"tool {tool!r}: $ref {value!r} is not supported in tool parameters "
                    "(only references inside the parameters themselves)",
                    param="tools",
                )
            _local_refs_only(value, tool)
    elif isinstance(node, list):
        for value in node:
            _local_refs_only(value, tool)


def _text_rules(fmt: ToolCallFormat, special: Mapping[str, int]) -> list[str]:
    """``text ::= text_open body``: body free text that starts with no call and holds no trigger.

    The exclusions' Aho-Corasick automaton, one rule per state (a trie node that is not a
    whole trigger): each rule may end, or read a character and go on in the next state;
    characters that would complete a trigger have no branch. The body starts in the root
    state, after any whitespace, through ``first``: the root state's branches less those
    of the characters ``text_never_starts`` forbids there.
    """
    triggers = TEXT_EXCLUSIONS
    never = set(fmt.text_never_starts)
    if never & set(_LEADING_SPACE):
        raise ValueError("text_never_starts is read after whitespace; it cannot hold whitespace")
    states = [""]  # trie nodes, by the prefix they stand for
    for trig in triggers:
        for i in range(1, len(trig)):
            if trig[:i] not in states:
                states.append(trig[:i])

    def step(prefix: str, ch: str) -> str | None:
        """The longest suffix of ``prefix + ch`` that is a state; None if it ends in a trigger."""
        s = prefix + ch
        if any(s.endswith(t) for t in triggers):
            return None
        for k in range(len(s)):
            if s[k:] in states:
                return s[k:]
        return ""

    alphabet = sorted({ch for t in triggers for ch in t})
    index = {s: i for i, s in enumerate(states)}

    def branches(prefix: str, banned: set[str]) -> list[str]:
        """The state's ways on: a character that advances the automaton, or any other one
        back to the root state; none for a character in ``banned`` or completing a trigger."""
        out: list[str] = []
        special = set(banned)  # characters that do not lead back to the root state
        for ch in alphabet:
            nxt = step(prefix, ch)
            if nxt == "" or ch in banned:
                continue
            special.add(ch)
            if nxt is not None:
                out.append(f"{_literal(ch)} {_RULE_PREFIX}s{index[nxt]}")
        rest = "".join(_char(c) for c in sorted(special))
        out.append(f"[^{rest}] {_RULE_PREFIX}s0" if rest else f"[^] {_RULE_PREFIX}s0")
        return out

    space = "".join(_char(c) for c in _LEADING_SPACE)
    rules = [f"{_RULE_PREFIX}text ::= {_spelled(fmt.text_open, special)} {_RULE_PREFIX}body"]
    if never:
        first = " | ".join(branches("", never | set(_LEADING_SPACE)))
        rules.append(f'{_RULE_PREFIX}body ::= "" | [{space}] {_RULE_PREFIX}body | {first}')
    else:
        rules.append(f"{_RULE_PREFIX}body ::= {_RULE_PREFIX}s0")
    for prefix in states:
        rules.append(f"{_RULE_PREFIX}s{index[prefix]} ::= {' | '.join([_literal(''), *branches(prefix, set())])}")
    return rules


def split_calls(text: str, tools: ToolGrammar) -> tuple[str, str | None]:
    """A complete output -> (the text before its calls, the calls' text; None: no calls).

    Text never holds a trigger, so the first ``call_start`` is where the calls begin (see
    the module doc); a format without text before calls has calls only at the start, after
    its ``special_open`` where the grammar admits that token (the calls' text is without it).
    """
    fmt = tools.format
    if fmt.special_open in tools.special and text.startswith(fmt.special_open):
        # Only the token: text never holds "<|", so no text answer starts so.
        return "", text[len(fmt.special_open) :]
    if not tools.text_allowed:
        return "", text
    if fmt.text_before_calls:
        at = text.find(fmt.call_start)
        return (text, None) if at < 0 else (text[:at], text[at:])
    return ("", text) if text.startswith(fmt.call_start) else (text, None)


def is_call_output(text: str, tools: ToolGrammar) -> bool:
    """Whether a complete output holds tool calls (after any text its format allows first)."""
    return split_calls(text, tools)[1] is not None


def _prefix_held(text: str, start: str) -> int:
    """The length of the longest end of ``text`` that ``start`` begins with (0: none)."""
    for n in range(min(len(text), len(start) - 1), 0, -1):
        if start.startswith(text[-n:]):
            return n
    return 0


class StreamSplit:
    """Which streamed text is held back (tool calls, sent whole once complete and checked) and
    which is sent as content as it comes. With text allowed, the output's start decides, once:
    held while it could still begin either branch, then text (after the format's ``text_open``)
    or calls for the rest of the answer. Where the format has text before calls, text is sent
    as it comes, less an end that could begin ``call_start`` (held until the next text decides
    it), and the calls start, for the rest of the answer, where ``call_start`` does."""

    def __init__(self, tools: ToolGrammar | None) -> None:
        self._tools = tools
        self.calls: bool = tools is not None and not tools.text_allowed
        self._undecided = tools is not None and (tools.text_allowed or tools.format.special_open in tools.special)
        self._start = ""

    def feed(self, text: str) -> tuple[str, str]:
        """``text`` (a delta) -> (content to send now, text held back as calls). Content never
        holds a marker the grammar admits as a special token: the grammar keeps them out of text,
        and should an output break it, the end check fails it and no marker was sent before."""
        content, calls = self._feed(text)
        if content and self._tools is not None and self._tools.special:
            content = _without_markers(content, self._tools)
        return content, calls

    def _feed(self, text: str) -> tuple[str, str]:
        if not self._undecided:
            return ("", text) if self.calls else (text, "")
        assert self._tools is not None
        fmt = self._tools.format
        start = self._start + text
        opener = fmt.special_open if fmt.special_open in self._tools.special else ""
        if opener and (start.startswith(opener) or opener.startswith(start)):
            if len(start) <= len(opener):
                self._start = start  # the opener, or the start of it: the calls follow
                return "", ""
            self.calls, self._undecided, self._start = True, False, ""
            return "", start[len(opener) :]
        if not self._tools.text_allowed:
            self._undecided, self._start = False, ""
            return "", start
        if fmt.text_before_calls:
            at = start.find(fmt.call_start)
            if at >= 0:
                self.calls, self._undecided, self._start = True, False, ""
                return start[:at], start[at:]
            cut = len(start) - _prefix_held(start, fmt.call_start)
            self._start = start[cut:]
            return start[:cut], ""
        if start.startswith(fmt.call_start):
            self.calls, self._undecided, self._start = True, False, ""
            return "", start
        if fmt.call_start.startswith(start) or fmt.text_open.startswith(start):
            self._start = start  # still a prefix of either branch
            return "", ""
        self._undecided, self._start = False, ""
        return start.removeprefix(fmt.text_open), ""

    @property
    def holding(self) -> int:
        """Characters fed but neither sent nor held as calls yet (a possible start of a call)."""
        return len(self._start)

    def pending(self) -> str:
        """Text still undecided when the output ends (a prefix of both branches): content."""
        assert self._tools is not None or not self._start
        return text_content(self._start, self._tools) if self._tools else ""


def text_content(text: str, tools: ToolGrammar) -> str:
    """The content of a text answer (or of an output cut short): without the format's ``text_open``,
    and without the markers the grammar admits as special tokens (a call cut short holds them;
    the client never gets one, as it never gets a special token)."""
    return _without_markers(text.removeprefix(tools.format.text_open), tools)


def _without_markers(text: str, tools: ToolGrammar) -> str:
    for marker in tools.special:
        text = text.replace(marker, "")
    return text


def parse_calls(text: str, tools: ToolGrammar, checker: OutputChecker) -> list[dict[str, Any]]:
    """The calls of a complete tool-call output as OpenAI ``tool_calls`` entries.

    ``function.arguments`` is the arguments' JSON text exactly as generated (and checked).
    Raises ``ValueError`` when the text is not well-formed calls in the format, names a tool
    outside the request's choice, makes more calls than allowed, or a call's arguments break
    its tool's schema: with a complete grammar that is a broken output, which the caller
    reports as an error.
    """
    fmt = tools.format
    if not text.startswith(fmt.calls_open) or not text.endswith(fmt.calls_close):
        raise ValueError(f"not {fmt.parser.value} tool calls: {text[:200]!r}")
    body = text[len(fmt.calls_open) : len(text) - len(fmt.calls_close)]
    # Longest head first: no tool's head may be read as another's.
    heads = sorted(((fmt.call_head(n), n) for n in tools.params), key=lambda h: -len(h[0]))
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    pos = 0
    while True:
        head = next(((h, n) for h, n in heads if body.startswith(h, pos)), None)
        if head is None:
            raise ValueError(f"a call at offset {pos} names none of the tools: {body[pos : pos + 200]!r}")
        start = pos + len(head[0])
        try:
            _, end = decoder.raw_decode(body, start)
        except ValueError as exc:
            raise ValueError(f"the arguments of {head[1]!r} are not JSON: {exc}") from None
        tail = tools.call_tail
        if not body.startswith(tail, end):
            raise ValueError(f"the call to {head[1]!r} does not end with {tail!r}")
        out.append(_checked_call(head[1], body[start:end], tools, checker))
        pos = end + len(tail)
        if pos == len(body):
            break
        if not fmt.separator or not body.startswith(fmt.separator, pos):
            raise ValueError(f"text after a call: {body[pos : pos + 200]!r}")
        pos += len(fmt.separator)
    if len(out) > tools.max_calls:
        raise ValueError(f"{len(out)} calls where at most {tools.max_calls} are allowed")
    return out


def _checked_call(name: str, arguments: str, tools: ToolGrammar, checker: OutputChecker) -> dict[str, Any]:
    if not isinstance(json.loads(arguments), dict):
        raise ValueError(f"the arguments of {name!r} are not a JSON object")
    spec = GrammarSpec(kind=GrammarKind.JSON_SCHEMA, text=json.dumps(tools.params[name]))
    try:
        verdict = checker.check(spec, arguments, "xgrammar")
    except OutputCheckError as exc:
        raise ValueError(f"the arguments of {name!r} could not be checked: {exc}") from None
    if not verdict.ok:
        raise ValueError(f"the arguments of {name!r} break its parameters schema: {verdict.reason}")
    return {
        "id": tools.format.call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def tools_prompt(tools: list[Tool], fmt: ToolCallFormat = HERMES) -> str:
    """System text for templates that cannot render tools: the tools and the call format (short:
    the listing counts against the context, and models without a template are the small ones)."""
    lines = [f"Tools, called as {fmt.calls_open}{fmt.call_head('f')}{{...}}{fmt.tail}{fmt.calls_close}:"]
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
