"""`specmask mask-service`'s flags are MaskServiceConfig's (and GrammarLimits') fields: each field
has its flag or a reason to have none, each flag is a field's, and a command line builds the
config the fields say. That the flags users pass still parse alike is tests/orchestrator/test_cli_flags.py."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from specmask.mask_service.grammar.limits import GrammarLimits
from specmask.mask_service.server.config import MaskServiceConfig
from specmask.mask_service.server.main import add_arguments, config_from_args, limit_flags, mask_service_flags
from specmask.mask_service.server.tokenizers import TokenizerSource

# MaskServiceConfig fields set in code only, each with why it has no flag.
CODE_ONLY = {
    "compile_threads": "the engine's threads per compile; a compile's CPU budget (--compile-timeout-s) bounds it",
    "compile_waiters": "sized with grpc_workers (half the gRPC threads), not tuned alone",
    "row_cache_bytes": "rows repeat across schemas: the default holds ~16k Llama-3 rows",
    "grpc_workers": "twice the compile waiters, so mask calls keep threads while compiles wait",
    "max_message_bytes": "sized for the largest batch --max-batch and --max-k allow",
    "janitor_interval_s": "how often idle sessions are looked for: --session-ttl-s is the knob",
    "grammar_limits": "a GrammarLimits: each of its fields is a flag (--max-schema-bytes, ...)",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmask mask-service")
    add_arguments(parser)
    return parser


def test_every_field_has_a_flag_or_a_reason() -> None:
    fields = {f.name for f in dataclasses.fields(MaskServiceConfig)}
    unexplained = sorted(fields - set(mask_service_flags().fields) - set(CODE_ONLY))
    assert not unexplained, f"MaskServiceConfig fields with no flag: give each one (config_flags.flag): {unexplained}"
    assert set(CODE_ONLY) <= fields and not set(CODE_ONLY) & set(mask_service_flags().fields)
    assert set(limit_flags().fields) == {f.name for f in dataclasses.fields(GrammarLimits)}


def test_every_flag_is_a_fields() -> None:
    """No flag is parsed by hand beside the fields' (it would be a second place to keep in step)."""
    parser = _parser()
    probe = argparse.ArgumentParser()
    mask_service_flags().add_to(probe)
    limit_flags().add_to(probe)
    declared = {a.dest for a in probe._actions if not isinstance(a, argparse._HelpAction)}
    on_parser = {a.dest for a in parser._actions if not isinstance(a, argparse._HelpAction)}
    assert on_parser == declared
    assert all(a.help for a in parser._actions), "every flag says what it does"


def test_the_command_lines_defaults_are_the_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECMASK_MASK_TOKEN", raising=False)
    config = config_from_args(_parser().parse_args(["--tokenizer", "tok"]))
    assert config == MaskServiceConfig(tokenizers=(TokenizerSource("tok"),))
    assert (config.metrics_port, config.auth_token, config.otlp_traces_endpoint) == (None, "", None)


def test_a_flag_reaches_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECMASK_MASK_TOKEN", "from-env")
    argv = ["--tokenizer", "/m/a:32000", "--tokenizer", "/m/b:", "--tokenizer", "C:\\tok", "--port", "0"]
    argv += ["--grammar-cache-mb", "3", "--compile-memory-mb", "2", "--max-memory-mb", "1"]
    argv += ["--max-schema-bytes", "10", "--max-schema-properties", "11", "--max-schema-depth", "12"]
    argv += ["--max-enum-values", "13", "--compile-sched-idle", "--metrics-port", "0", "--log-format", "json"]
    argv += ["--max-sessions-per-owner", "5", "--otlp-traces-endpoint", "", "--shutdown-grace-s", "0.5"]
    config = config_from_args(_parser().parse_args(argv))
    assert config.tokenizers == (
        TokenizerSource("/m/a", 32000),
        TokenizerSource("/m/b:"),  # no size after the colon: part of the path
        TokenizerSource("C:\\tok"),
    )
    assert (config.grammar_cache_bytes, config.compile_memory_bytes, config.max_memory_bytes) == (
        3 << 20,
        2 << 20,
        1 << 20,
    )
    assert config.grammar_limits == GrammarLimits(10, 11, 12, 13)
    assert config.compile_sched_idle and config.metrics_port == 0 and config.log_format == "json"
    assert config.max_sessions_per_owner == 5 and config.shutdown_grace_s == 0.5
    assert config.otlp_traces_endpoint is None  # a blank endpoint (a chart's empty value) is off
    assert config.auth_token == "from-env"  # not given: the environment's
    given = config_from_args(_parser().parse_args(["--tokenizer", "t", "--auth-token", ""]))
    assert given.auth_token == ""  # given, even empty, wins over the environment
    assert config_from_args(_parser().parse_args(["--tokenizer", "t", "--metrics-port", "-1"])).metrics_port is None


@pytest.mark.parametrize(
    "argv",
    [
        [],  # --tokenizer is required
        ["--tokenizer", "t", "--log-format", "xml"],
        ["--tokenizer", "t", "--session-ttl-s", "nan"],
        ["--tokenizer", "t", "--grammar-cache-mb", "0.5"],
    ],
)
def test_bad_command_lines_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)


def test_a_limit_out_of_range_is_a_bad_configuration() -> None:
    with pytest.raises(ValueError, match="max_nesting_depth must be >= 1"):
        config_from_args(_parser().parse_args(["--tokenizer", "t", "--max-schema-depth", "0"]))
