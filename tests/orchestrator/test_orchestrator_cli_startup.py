"""`specmask` start-up as an operator meets it: each mistake is one line on stderr and exit
status 2, found before Ray or any model is loaded; `--version`; one port-off convention."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from specmask.common.startup import EXIT_USAGE
from specmask.orchestrator import cli


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    return build_tiny_model_pair(tmp_path_factory.mktemp("cli-tiny"))


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other process holds (a listening socket)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


def assert_one_line(err: str, command: str, *fragments: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"specmask {command}: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in err


# ---------------------------------------------------------------- mask service


def _mask(tokenizer: Path | str, *extra: str) -> list[str]:
    return ["mask-service", "--host", "127.0.0.1", "--tokenizer", str(tokenizer), *extra]


def test_mask_service_missing_tokenizer(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(_mask("/nonexistent/tok", "--port", "0"), capsys)
    assert code == EXIT_USAGE
    assert_one_line(err, "mask-service", "--tokenizer /nonexistent/tok", "no such file")


def test_mask_service_dir_without_tokenizer_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(_mask(tmp_path, "--port", "0"), capsys)
    assert code == EXIT_USAGE
    assert_one_line(err, "mask-service", "no tokenizer.json")


def test_mask_service_port_in_use(models, busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(_mask(models[0], "--port", str(busy_port)), capsys)
    assert code == EXIT_USAGE
    assert_one_line(err, "mask-service", f"--port {busy_port}", "already in use")


def test_mask_service_metrics_port_clash(models, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, err = run_cli(_mask(models[0], "--port", str(port), "--metrics-port", str(port)), capsys)
    assert code == EXIT_USAGE
    assert_one_line(err, "mask-service", "--metrics-port and --port both name port")


def test_mask_service_port_out_of_range(models, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(_mask(models[0], "--port", "70000"), capsys)
    assert code == EXIT_USAGE
    assert_one_line(err, "mask-service", "port 70000 is out of range")


# ---------------------------------------------------------------- orchestrator


def _orch(target: Path | str, *extra: str) -> list[str]:
    return ["orchestrator", "--target", str(target), "--mask-service", "127.0.0.1:1", "--http-port", "-1", *extra]


def test_orchestrator_target_not_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(_orch(tmp_path, "--port", "0"), capsys)
    assert code == EXIT_USAGE
    assert_one_line(err, "orchestrator", "--target", "no config.json")


def test_orchestrator_unknown_model_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(_orch("no-such-model-name", "--port", "0"), capsys)
    assert code == EXIT_USAGE
    assert_one_line(err, "orchestrator", "bad model")


def test_orchestrator_target_without_tokenizer(models, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text((models[0] / "config.json").read_text())
    code, err = run_cli(_orch(target, "--port", "0"), capsys)
    assert code == EXIT_USAGE
    assert_one_line(err, "orchestrator", "no tokenizer.json")


def test_orchestrator_port_in_use(models, busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(_orch(models[0], "--draft", str(models[1]), "--port", str(busy_port)), capsys)
    assert code == EXIT_USAGE
    assert_one_line(err, "orchestrator", f"--port {busy_port}", "already in use")


def test_orchestrator_http_port_equals_grpc_port(models, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a for a in _orch(models[0], "--port", "50999") if a not in ("--http-port", "-1")] + ["--http-port", "50999"]
    code, err = run_cli(argv, capsys)
    assert code == EXIT_USAGE
    assert_one_line(err, "orchestrator", "--http-port and --port both name port 50999")


def test_orchestrator_bad_mask_service_address(models, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["orchestrator", "--target", str(models[0]), "--mask-service", "no-port-here", "--port", "0"]
    code, err = run_cli(argv, capsys)
    assert code == EXIT_USAGE
    assert_one_line(err, "orchestrator", "bad configuration", "host:port")


def test_orchestrator_metrics_off_convention() -> None:
    import argparse

    from specmask.orchestrator.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--target", "t", "--mask-service", "h:1"]
    assert config_from_args(parser.parse_args(base)).metrics_port is None  # default: off
    assert config_from_args(parser.parse_args([*base, "--metrics-port", "-1"])).metrics_port is None
    assert config_from_args(parser.parse_args([*base, "--metrics-port", "0"])).metrics_port == 0
    assert config_from_args(parser.parse_args([*base, "--http-port", "-1"])).http_port is None


# ---------------------------------------------------------------- the console script


def test_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "specmask.orchestrator.cli", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("specmask "), out


def test_console_script_exit_status_and_no_traceback() -> None:
    """The real process: exit status 2 and one line, nothing else on stderr."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "specmask.orchestrator.cli",
            "mask-service",
            "--tokenizer",
            "/nonexistent",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == EXIT_USAGE
    assert_one_line(out.stderr, "mask-service", "no such file")
