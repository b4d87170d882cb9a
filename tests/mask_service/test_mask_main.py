"""`specmask mask-service` as a real process: serves health, stops gracefully on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest


@pytest.mark.slow
def test_process_sigterm(bpe_dir) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specmask.orchestrator.cli",
            "mask-service",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--tokenizer",
            f"{bpe_dir}:640",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        deadline = time.monotonic() + 60
        while True:
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    break
            except grpc.RpcError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        # communicate() drains the pipe while waiting, so a chatty server can never
        # block on a full stdout; 60 s leaves room for a loaded 2-core CI box.
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out.decode(errors="replace")
        assert b"graceful shutdown" in out
    finally:
        if proc.poll() is None:
            proc.kill()
