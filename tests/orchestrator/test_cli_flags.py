"""Users' command lines keep working: every flag `specmask orchestrator`, `up`, `serve`,
`generate` and `mask-service` took when the flags came to be declared from the config
dataclasses is still there, with the same destination, default, type, choices and arity.

tests/orchestrator/data/cli_flags.json is the record of those flags, as their parsers said
(``python -m tests.orchestrator.test_cli_flags`` prints today's, to compare by eye). A flag
may be added, and may gain help; one removed, renamed or given another default or type
fails here, unless INTENDED names the change and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from specmask.common import config_flags
from specmask.orchestrator.cli import SUBCOMMANDS

RECORD = Path(__file__).parent / "data" / "cli_flags.json"
COMMANDS = ("orchestrator", "up", "serve", "generate", "mask-service")
# Recorded defaults that are the machine's, not a constant: what each stands for here.
MACHINE_DEFAULTS: dict[str, Any] = {"<os.cpu_count()>": os.cpu_count() or 1}

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


def _type_name(action: argparse.Action) -> str | None:
    if action.type is None:
        return "str" if action.nargs != 0 else None  # no type and str read a value alike
    if action.type is config_flags._number:
        return "float"  # a float that refuses NaN: every value a float flag took before parses alike
    return str(_plain(action.type))


def describe(action: argparse.Action) -> dict[str, Any]:
    """What a command line depends on in one argparse action."""
    return {
        "dest": action.dest,
        "default": _plain(action.default),
        "type": _type_name(action),
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
    for before in recorded.values():  # recorded before "no type" was read as str
        if before["type"] is None and before["takes_value"]:
            before["type"] = "str"
        if isinstance(before["default"], str) and before["default"] in MACHINE_DEFAULTS:
            before["default"] = MACHINE_DEFAULTS[before["default"]]
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


# OrchestratorConfig fields set in code only, each with why it has no flag.
CODE_ONLY = {
    "api_keys": "auth_keys' --api-key / --api-key-file, read together with the environment's keys",
    "mask_max_retries": "a client retry count, tuned with the router, not per deployment",
    "validation_threads": "bounded by --max-queue anyway",
}


def test_every_field_has_a_flag_or_a_reason() -> None:
    from specmask.orchestrator.config import OrchestratorConfig
    from specmask.orchestrator.main import orchestrator_flags

    fields = {f.name for f in dataclasses.fields(OrchestratorConfig)}
    unexplained = sorted(fields - set(orchestrator_flags().fields) - set(CODE_ONLY))
    assert not unexplained, f"OrchestratorConfig fields with no flag: give each one (config_flags.flag): {unexplained}"
    assert set(CODE_ONLY) <= fields


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_says_what_it_does(command: str) -> None:
    silent = [a.option_strings for a in parser_of(command)._actions if not a.help]
    assert not silent, f"`specmask {command}` flags without help: {silent}"


def test_the_command_lines_defaults_are_the_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every default on the command line builds the config's own default, but the HTTP API's port
    (on at 8000 from the command line, off in code)."""
    from specmask.orchestrator.config import CLI_HTTP_PORT, OrchestratorConfig
    from specmask.orchestrator.main import config_from_args

    for env in ("SPECMASK_API_KEY", "SPECMASK_API_KEYS"):
        monkeypatch.delenv(env, raising=False)
    args = parser_of("orchestrator").parse_args(["--target", "t", "--mask-service", " a:1 ,, b:2 "])
    built = OrchestratorConfig(target_dir="t", mask_service_addresses=("a:1", "b:2"), http_port=CLI_HTTP_PORT)
    assert config_from_args(args) == built


def test_a_flag_reaches_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from specmask.orchestrator.api.http.tool_formats import ToolCallParser
    from specmask.orchestrator.main import config_from_args
    from specmask.orchestrator.reasoning import ReasoningParser
    from specmask.orchestrator.validation import GrammarFallback

    monkeypatch.setenv("SPECMASK_API_KEY", "from-env")
    argv = ["--target", "t", "--mask-service", "a:1", "--metrics-port", "0", "--http-port", "-1"]
    argv += ["--max-num-seqs", "3", "--cors-origin", "https://a.example", "--cors-origin", "*", "--api-key", "k"]
    argv += ["--grammar-fallback", "refuse", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"]
    argv += ["--schema-instruction", "--grammar-verdict-cache", "0", "--log-level", "WARNING"]
    config = config_from_args(parser_of("orchestrator").parse_args(argv))
    assert (config.metrics_port, config.http_port, config.max_batch) == (0, None, 3)
    assert config.cors_origins == ("https://a.example", "*") and config.api_keys == ("k", "from-env")
    assert config.grammar_fallback is GrammarFallback.REFUSE and config.reasoning_parser is ReasoningParser.QWEN3
    assert config.tool_call_parser is ToolCallParser.HERMES and config.schema_instruction
    assert (config.grammar_verdict_cache_entries, config.worker_log_level) == (0, "WARNING")
