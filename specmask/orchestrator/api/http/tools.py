"""Tool calling as a grammar: ``tools`` + ``tool_choice`` -> one JSON schema, and the output back to calls.

The output is constrained to one JSON object ``{"name": <tool>, "arguments":
<that tool's parameters>}``: with ``tool_choice: "required"`` any of the tools,
with a named function only that one. ``"none"`` means no call (no grammar from
the tools). ``"auto"`` (and tools without ``tool_choice``), where the model
decides between text and calls, is ``tool_grammar``'s: its grammar admits free
text too. One call per response here.

Each tool's ``$defs``/``definitions`` are hoisted to the combined schema's root
under ``<tool>__<name>`` and its local ``$ref``s rewritten, since a pointer
like ``#/$defs/x`` resolves from the root of the document it sits in.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from specmask.orchestrator.api.http.errors import ApiError
from specmask.orchestrator.api.http.protocol import NamedToolChoice, Tool

_DEF_KEYS = ("$defs", "definitions")


def call_schema(tools: list[Tool], choice: str | NamedToolChoice | None) -> dict[str, Any] | None:
    """The schema a tool call must match, or None when the tools impose no constraint ("none")."""
    if choice is None or choice == "auto":
        raise ApiError.invalid(
            'tool_choice "auto" is not a single call schema (see tool_grammar); '
            'use "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if choice == "none":
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError.invalid("tool function names must be unique", param="tools")
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise ApiError.invalid(
                f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice"
            )
    else:
        chosen = tools
    defs: dict[str, Any] = {}
    branches = [_call_branch(tool, defs) for tool in chosen]
    schema: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    if defs:
        schema = {"$defs": defs, **schema}
    return schema


def _call_branch(tool: Tool, defs: dict[str, Any]) -> dict[str, Any]:
    name = tool.function.name
    params: dict[str, Any] = {"type": "object"}
    if tool.function.parameters is not None:
        params = dict(tool.function.parameters)
    local: dict[str, Any] = {}
    for key in _DEF_KEYS:
        for def_name, sub in (params.pop(key, None) or {}).items():
            local[f"#/{key}/{def_name}"] = f"#/$defs/{name}__{def_name}"
            defs[f"{name}__{def_name}"] = sub
    params = _rewrite_refs(params, local, name)
    for new in local.values():
        target = new.removeprefix("#/$defs/")
        defs[target] = _rewrite_refs(defs[target], local, name)
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _rewrite_refs(node: Any, local: dict[str, str], tool: str) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                if value not in local:
                    raise ApiError.invalid(
                        f"tool {tool!r}: $ref {value!r} is not supported in tool parameters "
                        "(only references into the parameters' own $defs/definitions)",
                        param="tools",
                    )
                out[key] = local[value]
            else:
                out[key] = _rewrite_refs(value, local, tool)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, local, tool) for v in node]
    return node


def parse_call(text: str) -> dict[str, Any]:
    """The generated (grammar-complete) call as an OpenAI ``tool_calls`` entry.

    Raises ``ValueError`` if the text is not a call: with a complete grammar
    that means the output broke its grammar, which the caller reports as an error.
    """
    call = json.loads(text)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        raise ValueError(f"not a tool call object: {text[:200]!r}")
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
    }


def describe_tools(tools: list[Tool]) -> str:
    """Plain-text tool list for prompts whose chat template cannot render tools itself."""
    lines = ['You can call one of these tools; answer with {"name": ..., "arguments": ...}:']
    for tool in tools:
        fn = tool.function
        params = json.dumps(fn.parameters or {}, separators=(",", ":"))
        lines.append(f"- {fn.name}: {fn.description or ''} parameters: {params}")
    return "\n".join(lines)
