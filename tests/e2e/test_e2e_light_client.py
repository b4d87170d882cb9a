"""The light client: the built wheel installed alone (grpcio + protobuf, nothing else) into a
fresh venv, used against the running stack, sync, async and over TLS (a second, TLS port on
the stack's own engine).

The venv gets the wheel with --no-deps plus exactly the base dependencies; pip
fetches them from its cache or the index (skipped, with the reason, when
neither can serve them: an offline machine with a cold cache).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import grpc
import pytest

from tests.e2e.stack import BOUNDED_SCHEMA, PROMPT, REPO_ROOT, ThreadStack

pytestmark = pytest.mark.slow

BASE_DEPENDENCIES = ("grpcio==1.85.1", "protobuf==7.36.2")  # pyproject.toml [project] dependencies
HEAVY = ("torch", "xgrammar", "transformers", "numpy", "ray", "tokenizers", "aiohttp", "triton")

CLIENT_SCRIPT = r"""
import asyncio, json, sys
from specmask.orchestrator.client import AsyncOrchestratorClient, OrchestratorClient, build_request

address, tls_address, schema, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
roots = open(sys.argv[5], "rb").read()
out = {"loaded_heavy": [m for m in HEAVY if m in sys.modules]}
req = build_request(prompt, schema=schema, temperature=1.0, seed=7, max_tokens=64)
with OrchestratorClient(address) as client:
    resp = client.generate(req)
    out["sync"] = [resp.text, resp.finish_reason]

async def main():
    async with AsyncOrchestratorClient(address) as client:
        result = await client.stream_all(req)
        out["async"] = [result.text, result.finish_reason_name, len(result.text_deltas)]
    options = [("grpc.ssl_target_name_override", "localhost")]
    async with AsyncOrchestratorClient(tls_address, tls=True, root_certificates=roots, options=options) as client:
        resp = await client.generate(req)
        out["tls"] = [resp.text, resp.finish_reason]

asyncio.run(main())
try:
    import torch  # noqa: F401
    out["torch_importable"] = True
except ImportError:
    out["torch_importable"] = False
print("RESULT " + json.dumps(out))
"""


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, **kwargs)


def _self_signed(tmp: Path) -> tuple[bytes, bytes]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed (needed to make a test certificate)")
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    proc = _run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)]
    )
    assert proc.returncode == 0, proc.stderr
    return key.read_bytes(), cert.read_bytes()


async def _tls_server(stack: ThreadStack, key: bytes, cert: bytes) -> tuple[grpc.aio.Server, int]:
    """A second gRPC server with TLS on the stack's loop, serving the stack's own engine."""
    from specmask.orchestrator.api.grpc_server import SERVICE_NAME
    from specmask.orchestrator.api.grpc_servicer import OrchestratorServicer, add_to_server

    assert stack.running is not None
    server = grpc.aio.server()
    add_to_server(OrchestratorServicer(stack.running.server.engine, stack.running.server.metrics), server, SERVICE_NAME)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    await server.start()
    return server, port


def test_client_installed_alone_in_a_fresh_venv(stack: ThreadStack, tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    build = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), "."],
        cwd=REPO_ROOT,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("specmask-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    assert _run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)]).returncode == 0
    deps = _run([py, "-m", "pip", "install", "-q", *BASE_DEPENDENCIES])
    if deps.returncode != 0:
        pytest.skip(f"grpcio/protobuf not installable here (no index, cold cache): {deps.stderr[-300:]}")
    installed = _run([py, "-m", "pip", "list", "--format=json"])
    names = {p["name"].lower() for p in json.loads(installed.stdout)}
    assert names <= {"specmask", "grpcio", "protobuf", "typing-extensions", "typing_extensions", "pip", "setuptools"}
    key, cert = _self_signed(tmp_path)
    (tmp_path / "roots.pem").write_bytes(cert)
    tls_server, tls_port = stack.run(_tls_server(stack, key, cert))
    try:
        script = f"HEAVY = {HEAVY!r}\n" + CLIENT_SCRIPT
        args = [stack.address, f"127.0.0.1:{tls_port}", json.dumps(BOUNDED_SCHEMA), PROMPT, str(tmp_path / "roots.pem")]
        proc = _run([py, "-c", script, *args], cwd=tmp_path)
    finally:
        stack.run(tls_server.stop(None))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["loaded_heavy"] == [] and result["torch_importable"] is False
    from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb

    for key_name in ("sync", "tls"):
        text, finish = result[key_name]
        assert finish == pb.FINISH_REASON_GRAMMAR_COMPLETE
        json.loads(text)
    text, finish_name, deltas = result["async"]
    assert finish_name == "grammar_complete" and deltas > 1
    json.loads(text)
