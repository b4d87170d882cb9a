"""`specmask up` + `specmask generate` as real processes; Ctrl-C stops everything, nothing orphaned."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import jsonschema
import pytest

from tests.e2e.stack import BOUNDED_SCHEMA
from tests.fixtures.procs import exited

pytestmark = pytest.mark.slow

UP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 90.0


def wait_until_up(proc: subprocess.Popen[str], command: str, lines: list[str]) -> str:
    """Read the process's output into ``lines`` until its "specmask is up" line, which is returned;
    fails if it exits first or UP_TIMEOUT_S passes."""
    deadline = time.monotonic() + UP_TIMEOUT_S
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, f"`specmask {command}` exited early:\n{''.join(lines)}"
        lines.append(line)
        if line.startswith("specmask is up"):
            return line
        assert time.monotonic() < deadline, "".join(lines)


def assert_mask_service_locked(up_line: str) -> None:
    """Every mask service named in the "specmask is up" line listens on loopback and refuses a
    MaskService call without the token its stack made for this start (real gRPC)."""
    from specmask.mask_service.client.mask_client import MaskServiceClient, MaskServiceError

    named = re.search(r"mask service (.+?), \d+ worker\(s\)", up_line)
    assert named, up_line
    for address in named.group(1).split(", "):
        assert address.startswith("127.0.0.1:"), address
        stranger = MaskServiceClient(address, auth_token="", deadline_s=10.0, max_retries=0, own_connection=True)
        with stranger, pytest.raises(MaskServiceError) as info:
            stranger.release_owner("anyone")
        assert info.value.code is grpc.StatusCode.UNAUTHENTICATED, info.value


def _descendants(pid: int) -> dict[int, bytes]:
    """pid -> cmdline of every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The comm field may contain spaces; ppid is the 2nd field after it.
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in found:
                try:
                    found[child] = Path(f"/proc/{child}/cmdline").read_bytes()
                except OSError:
                    continue
                frontier.append(child)
    return found


def _logged_port(log_path: Path, pattern: str, proc: subprocess.Popen) -> int:
    """The port a child logged (it was started with port 0), once the line appears."""
    deadline = time.monotonic() + UP_TIMEOUT_S
    while True:
        match = re.search(pattern, log_path.read_text(errors="replace"))
        if match:
            return int(match.group(1))
        assert proc.poll() is None, f"exited early:\n{log_path.read_text(errors='replace')[-3000:]}"
        assert time.monotonic() < deadline, f"no {pattern!r} in the log"
        time.sleep(0.2)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "specmask.orchestrator.cli", *args]


def test_up_generate_and_ctrl_c(tiny_pair, tmp_path: Path) -> None:
    target, draft = tiny_pair
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen(
        _cli(
            "up",
            "--target",
            str(target),
            "--draft",
            str(draft),
            # Port 0: the server binds a free port itself and prints it (a port picked
            # here could be taken before the child binds it, e.g. by Ray starting up).
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--http-port",  # the default 8000 may be taken on a shared machine
            "0",
            "--log-dir",
            str(tmp_path / "logs"),
            "--log-level",
            "WARNING",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    lines: list[str] = []
    try:
        match = re.search(r"API 127\.0\.0\.1:(\d+)", wait_until_up(up, "up", lines))
        assert match, lines[-1]
        port = int(match.group(1))
        assert_mask_service_locked(lines[-1])
        schema_file = tmp_path / "schema.json"
        schema_file.write_text(json.dumps(BOUNDED_SCHEMA))
        gen = subprocess.run(
            _cli(
                "generate",
                "--address",
                f"127.0.0.1:{port}",
                "--schema",
                str(schema_file),
                "--prompt",
                "A user:\n",
                "--stream",
                "--temperature",
                "0.8",
                "--seed",
                "5",
                "--json",
            ),
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert gen.returncode == 0, gen.stderr
        out = json.loads(gen.stdout)
        assert out["finish_reason"] == "grammar_complete"
        jsonschema.validate(json.loads(out["text"]), BOUNDED_SCHEMA)
        assert "tokens/forward=" in gen.stderr
        refused = subprocess.run(
            _cli("generate", "--address", f"127.0.0.1:{port}", "--regex", "(", "--prompt", "x"),
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr
        children = _descendants(up.pid)
        assert any(b"mask-service" in c for c in children.values()), children
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=STOP_TIMEOUT_S)
        lines.append(rest)
        assert up.returncode == 0, "".join(lines)
        assert "stopped" in rest
        deadline = time.monotonic() + 30
        while (alive := [p for p, c in children.items() if not exited(p, c)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive, {p: children[p] for p in alive}
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)


def test_orchestrator_process_serves_and_stops_on_sigterm(tiny_pair, tmp_path: Path) -> None:
    """`specmask orchestrator` as its own process against a separate mask-service process."""
    import urllib.request

    from specmask.orchestrator.client import OrchestratorClient, build_request
    from specmask.orchestrator.dev.local_stack import MaskServiceProcess, wait_serving
    from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb

    target, draft = tiny_pair
    mask = MaskServiceProcess([str(target)], log_path=tmp_path / "mask.log").start()
    log_path = tmp_path / "orchestrator.log"
    log = open(log_path, "wb")  # noqa: SIM115
    orch = subprocess.Popen(
        _cli(
            "orchestrator",
            "--port",
            "0",
            "--mask-service",
            mask.address,
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--metrics-port",
            "0",
            "--http-port",
            "0",
            "--ray-address",
            "local",
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # Port 0 for both: the process binds free ports itself and logs them.
        port = _logged_port(log_path, r"orchestrator serving on 127\.0\.0\.1:(\d+)", orch)
        metrics_port = _logged_port(log_path, r"metrics on http://127\.0\.0\.1:(\d+)/metrics", orch)
        wait_serving(f"127.0.0.1:{port}", UP_TIMEOUT_S, process=orch)
        with OrchestratorClient(f"127.0.0.1:{port}") as client:
            resp = client.generate(build_request("A user:\n", schema=BOUNDED_SCHEMA, temperature=0.0, max_tokens=64))
        assert resp.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE, resp.error
        jsonschema.validate(json.loads(resp.text), BOUNDED_SCHEMA)
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'specmask_requests_total{finish_reason="grammar_complete"} 1.0' in body
        children = _descendants(orch.pid)
        orch.send_signal(signal.SIGTERM)
        assert orch.wait(STOP_TIMEOUT_S) == 0, (tmp_path / "orchestrator.log").read_text()
        deadline = time.monotonic() + 30
        while (alive := [p for p, c in children.items() if not exited(p, c)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive, {p: children[p] for p in alive}
        assert mask.running  # the orchestrator never owned it
    finally:
        if orch.poll() is None:
            orch.kill()
            orch.wait(30)
        log.close()
        mask.stop()
