"""Ports and the local Ray: a taken port is refused before anything starts (one line, exit
status 2), no gRPC server shares its port (no SO_REUSEPORT), and a local Ray listens on
127.0.0.1 only. Real sockets, real grpc.aio servers, a real `specmask up` process, real Ray."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

from specmask.orchestrator.api.grpc_server import server_options

REPO = Path(__file__).resolve().parents[3]


def test_two_grpc_servers_cannot_share_a_port() -> None:
    """Before, with gRPC's default SO_REUSEPORT, the second server bound the same port and
    the kernel split connections between two stacks."""

    async def run() -> int:
        first = grpc.aio.server(options=server_options())
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        second = grpc.aio.server(options=server_options())
        try:
            try:
                bound = second.add_insecure_port(f"127.0.0.1:{port}")
            except RuntimeError:
                bound = 0
            return bound
        finally:
            await first.stop(0)
            await second.stop(0)

    assert asyncio.run(run()) == 0


def test_up_refuses_a_taken_port_in_one_line_before_ray() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "specmask.orchestrator.cli", "up", "--port", str(port), "--metrics-port", "-1"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        took = time.monotonic() - t0
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"specmask up: error: --port {port} on 127.0.0.1: already in use"], proc.stderr[-2000:]
    assert "Ray" not in proc.stdout + proc.stderr
    assert took < 120.0, took


_PROBE = """
import json, os, time
import psutil
import ray.exceptions  # as the engine does: ray imported before the stack connects
from specmask.orchestrator.worker_pool import connect_ray

assert connect_ray("local", log_to_driver=False)
import ray

@ray.remote
def ping() -> int:
    return 1

assert ray.get(ping.remote(), timeout=120) == 1
tree = [psutil.Process()] + psutil.Process().children(recursive=True)
listening = []
for proc in tree:
    try:
        conns = proc.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        continue
    listening += [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
print("LISTEN " + json.dumps(sorted(set(listening))))
ray.shutdown()
"""


def test_local_ray_listens_on_loopback_only() -> None:
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("LISTEN ")]
    addresses = json.loads(line[len("LISTEN ") :])
    assert addresses, "no Ray listener found"
    assert all(a in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for a in addresses), addresses


def test_up_refuses_an_unreadable_key_file_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-keys"
    cmd = [sys.executable, "-m", "specmask.orchestrator.cli", "up", "--port", "0", "--metrics-port", "-1",
           "--http-port", "-1", "--api-key-file", str(missing)]  # fmt: skip
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"specmask up: error: --api-key-file {missing}: No such file or directory"], proc.stderr[-2000:]
