"""Users' command lines keep working: every flag `specmask orchestrator`, `up`, `serve` and
`generate` took when the flags came to be declared from the config dataclasses is still
there, with the same destination, default, type, choices and arity.

tests/orchestrator/data/cli_flags.json is the record of those flags, as their parsers said
(``python -m tests.orchestrator.test_cli_flags`` prints today's, to compare by eye). A flag
may be added, and may gain help; one removed, renamed or given another default or type
fails here, unless INTENDED names the change and why.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from specmask.orchestrator.cli import SUBCOMMANDS

RECORD = Path(__file__).parent / "data" / "cli_flags.json"
COMMANDS = ("orchestrator", "up", "serve", "generate")

# (command, flag) -> (attribute, the value it has now, why it changed). Each one keeps every
# command line that worked before working the same way.
INTENDED: dict[tuple[str, str], tuple[str, Any, str]] = {}


def parser_of(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"specmask {command}")
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    return parser


def _plain(value: Any) -> Any:
    """A default or choice as JSON can hold it: enums by value, callables and types by name."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "value"):
        return value.value
    return getattr(value, "__name__", repr(value))


def describe(action: argparse.Action) -> dict[str, Any]:
    """What a command line depends on in one argparse action."""
    return {
        "dest": action.dest,
        "default": _plain(action.default),
        "type": _plain(action.type),
        "choices": _plain(list(action.choices)) if action.choices is not None else None,
        "nargs": action.nargs,
        "required": action.required,
        "takes_value": action.nargs != 0,
    }


def flags_of(parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    """Every option string (or positional dest) -> its action's description."""
    out: dict[str, dict[str, Any]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for name in action.option_strings or [action.dest]:
            out[name] = describe(action)
    return out


def current() -> dict[str, dict[str, dict[str, Any]]]:
    return {command: flags_of(parser_of(command)) for command in COMMANDS}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_recorded_flag_still_parses_alike(command: str) -> None:
    recorded: dict[str, dict[str, Any]] = json.loads(RECORD.read_text())[command]
    now = flags_of(parser_of(command))
    missing = sorted(set(recorded) - set(now))
    assert not missing, f"`specmask {command}` lost flags users may pass: {missing}"
    changed = []
    for flag, before in recorded.items():
        for attribute, value in before.items():
            after = now[flag][attribute]
            intended = INTENDED.get((command, flag))
            if after != value and not (intended and intended[0] == attribute and intended[1] == after):
                changed.append(f"{flag} {attribute}: {value!r} -> {after!r}")
    assert not changed, f"`specmask {command}`: " + "; ".join(changed)


if __name__ == "__main__":
    json.dump(current(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
