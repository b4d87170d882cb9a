"""`specmask up` and `specmask serve` start through one path (orchestrator.dev.launch): the same
flags with the same defaults, the same fields for the orchestrator, and the same refusals (one
line, exit status 2) before anything slow starts and before a mask-service token is made.

In process through the real CLI entry point, with real sockets; the started stacks themselves
(a refused unauthenticated mask-service call included) are tests/e2e_cli's."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from specmask.common.startup import EXIT_USAGE
from specmask.mask_service.auth import OWNER_SECRET_ENV, TOKEN_ENV
from specmask.orchestrator import cli
from specmask.orchestrator.api.http.tool_formats import ToolCallParser
from specmask.orchestrator.dev import serve, up
from specmask.orchestrator.dev.launch import Launch, PortFlag, add_stack_arguments, config_overrides
from specmask.orchestrator.reasoning import ReasoningParser
from specmask.orchestrator.validation import GrammarFallback

# Ports that are never reached: every refusal below comes before any bind.
FREE = ["--port", "0"]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other socket holds (listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(autouse=True)
def no_stack_secrets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No token in the environment before; a refused start must not have made one either."""
    for name in (TOKEN_ENV, OWNER_SECRET_ENV, "SPECMASK_API_KEY", "SPECMASK_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    yield
    assert TOKEN_ENV not in os.environ and OWNER_SECRET_ENV not in os.environ


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a refused start."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == EXIT_USAGE and len(lines) == 1, (code, err)
    assert "Traceback" not in err
    return lines[0]


def serve_argv(*extra: str, model: str = "acme/not-cached") -> list[str]:
    return ["serve", model, "--port", "0", "--grpc-port", "0", "--metrics-port", "-1", *extra]


def up_argv(*extra: str) -> list[str]:
    return ["up", "--target", "acme/not-cached", "--port", "0", "--http-port", "0", "--metrics-port", "-1", *extra]


@pytest.mark.parametrize("flag", ["--port", "--grpc-port", "--metrics-port"])
def test_serve_refuses_a_taken_port(flag: str, busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before the model: the model named here is not even cached."""
    line = refused(serve_argv(flag, str(busy_port)), capsys)
    assert line == f"specmask serve: error: {flag} {busy_port} on 127.0.0.1: already in use"


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_up_refuses_a_taken_port(flag: str, busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(up_argv(flag, str(busy_port)), capsys)
    assert line == f"specmask up: error: {flag} {busy_port} on 127.0.0.1: already in use"


def test_serve_checks_ports_on_its_host(capsys: pytest.CaptureFixture[str]) -> None:
    """--host moves the public ports, so they are checked there: an address this machine lacks
    is refused as such (`up`'s ports are always on loopback)."""
    line = refused(serve_argv("--host", "192.0.2.1", "--port", "8123"), capsys)  # TEST-NET-1
    assert line == "specmask serve: error: --port 8123 on 192.0.2.1: the host is not an address of this machine"


def test_two_flags_naming_one_port(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    line = refused(serve_argv("--port", port, "--grpc-port", port), capsys)
    assert line == f"specmask serve: error: --port and --grpc-port both name port {port}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (serve_argv("--grpc-port", "-1"), "specmask serve: error: --grpc-port -1: the gRPC API cannot be off"),
        (up_argv("--port", "-1"), "specmask up: error: --port -1: the gRPC API cannot be off"),
        (serve_argv("--port", "65536"), "specmask serve: error: port 65536 is out of range"),
        (serve_argv("--mask-replicas", "0"), "specmask serve: error: --mask-replicas must be at least 1, got 0"),
        (up_argv("--num-workers", "-2"), "specmask up: error: --num-workers must be at least 1, got -2"),
        (serve_argv("--speculative-config", "{"), "specmask serve: error: --speculative-config is not JSON"),
    ],
)
def test_flag_mistakes_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(argv, capsys).startswith(message)


def test_unreadable_key_file_is_refused_before_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-keys"
    line = refused(serve_argv("--api-key-file", str(missing)), capsys)
    assert line == f"specmask serve: error: --api-key-file {missing}: No such file or directory"


def test_uncached_hub_id_names_hf_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    line = refused(serve_argv(model="acme/absent"), capsys)
    assert line.startswith("specmask serve: error: bad model: 'acme/absent' is not in the local Hugging Face cache")
    assert line.endswith("`hf download acme/absent`"), line


def test_bad_configuration_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--max-queue 0 reaches the orchestrator's configuration, which refuses it before a mask
    service or Ray starts (and before a token is made: the autouse fixture checks)."""
    from tests.fixtures.tiny_models import build_tiny_model_pair

    target, _ = build_tiny_model_pair(tmp_path)
    capsys.readouterr()  # the build's progress bars
    for argv in (serve_argv("--max-queue", "0", model=str(target)), ["up", "--target", str(target), "--draft", "none",
                 "--port", "0", "--http-port", "0", "--metrics-port", "-1", "--max-queue", "0"]):  # fmt: skip
        line = refused(argv, capsys)
        assert line.endswith("error: bad configuration: max_queue must be >= 1, got 0"), line


def _parsed(add_arguments, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_up_and_serve_share_flags_and_defaults() -> None:
    shared = vars(_parsed(add_stack_arguments, []))
    up_args, serve_args = vars(_parsed(up.add_arguments, [])), vars(_parsed(serve.add_arguments, ["m"]))
    assert {k: up_args[k] for k in shared} == shared == {k: serve_args[k] for k in shared}
    assert shared["log_dir"] == ".specmask/logs"  # a crashed mask replica leaves its log under both


def test_shared_flags_reach_the_orchestrator_alike() -> None:
    flags = ["--api-key", "k1", "--cors-origin", "https://a.example", "--max-inflight-per-client", "3"]
    flags += ["--max-queue", "7", "--max-num-seqs", "9", "--max-num-batched-tokens", "96", "--kv-cache-bytes", "4096"]
    flags += ["--dtype", "bfloat16", "--reasoning-parser", "qwen3", "--num-workers", "2", "--log-level", "DEBUG"]
    flags += ["--otlp-traces-endpoint", "http://127.0.0.1:4317"]

    def models() -> tuple[str, str | None]:
        raise AssertionError("building the fields resolves no model")

    up_plan = Launch("127.0.0.1", PortFlag("--port", 0), PortFlag("--http-port", 0), PortFlag("-m", -1), models)
    up_fields = config_overrides(_parsed(up.add_arguments, flags), up_plan, http_port=0)
    serve_args = _parsed(serve.add_arguments, ["dir", "--host", "0.0.0.0", "--max-model-len", "64", *flags])
    own = serve.orchestrator_overrides(serve_args, serve.Speculative(None, 3))
    assert own == {"served_model_name": "dir", "max_model_len": 64, "default_k": 3}
    serve_plan = Launch("0.0.0.0", up_plan.grpc, up_plan.http, up_plan.metrics, models, own)
    serve_fields = config_overrides(serve_args, serve_plan, http_port=0)
    shared = {
        "http_port": 0,
        "max_queue": 7,
        "max_inflight_per_client": 3,
        "api_keys": ("k1",),
        "cors_origins": ("https://a.example",),
        "max_batch": 9,  # vLLM's names for --max-batch and --max-iteration-tokens
        "max_iteration_tokens": 96,
        "gpu_memory_utilization": None,
        "kv_cache_bytes": 4096,
        "dtype": "bfloat16",
        "reasoning_parser": ReasoningParser.QWEN3,
        "grammar_fallback": GrammarFallback.CHECKED,  # the defaults of the other shared flags
        "tool_call_parser": ToolCallParser.AUTO,
        "num_workers": 2,
        "worker_log_level": "DEBUG",
        "otlp_traces_endpoint": "http://127.0.0.1:4317",  # the stack's mask services get it too
    }
    assert up_fields == {"host": "127.0.0.1", **shared}
    assert serve_fields == {"host": "0.0.0.0", **shared, **own}
