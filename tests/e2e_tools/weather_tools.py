"""The tools the tool-call e2e tests offer, and checks of what comes back."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import jsonschema

# Bounded arguments: a random model's forced calls (up to 4 in parallel) complete within max_tokens.
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
STOP = {"type": "object", "properties": {}, "additionalProperties": False}
PARAMS = {"get_weather": WEATHER, "stop": STOP}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": params}}
    for name, params in PARAMS.items()
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_arguments(name: str, arguments: str) -> None:
    """A call's arguments validate against its tool's parameters."""
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def streamed_calls(deltas: Iterable[Any]) -> dict[int, dict[str, str]]:
    """index -> name and arguments of the calls in a stream's ``delta.tool_calls`` entries, as
    vLLM sends them: a call's first delta has its id and name and no arguments, the rest add to
    its arguments."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls and d.function is not None and d.function.name
            calls[d.index] = {"name": d.function.name, "arguments": ""}
        else:
            assert d.function is not None and d.function.arguments is not None
            calls[d.index]["arguments"] += d.function.arguments
    return calls
