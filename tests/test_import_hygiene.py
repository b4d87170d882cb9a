"""Each role imports only what it runs: the seams of the light installs.

Every check runs in a fresh interpreter with the named packages blocked (an
import of one raises ImportError), so a stray top-level import anywhere in the
module's import graph fails here, not in a slim container.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

_BLOCKER = """
import importlib, sys
BLOCKED = set(sys.argv[1].split(","))
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked import of {name}")
sys.meta_path.insert(0, Block())
for module in sys.argv[2].split(","):
    importlib.import_module(module)
"""

CASES = {
    # The gRPC client: grpcio + protobuf only (pip install specmask[client]).
    "client": (
        ["specmask.orchestrator.client"],
        ["torch", "xgrammar", "transformers", "numpy", "ray", "aiohttp", "tokenizers", "xxhash", "jsonschema"]
        + ["grpc_status", "grpc_health", "grpc_reflection", "pydantic", "jinja2"],
    ),
    # The mask-service client side (worker and orchestrator use it): no grammar engine.
    "mask_client": (
        [
            "specmask.mask_service.client.mask_client",
            "specmask.mask_service.client.router",
            "specmask.mask_service.client.replicas",
            "specmask.mask_service.wire",
        ],
        ["torch", "xgrammar", "transformers", "llguidance"],
    ),
    # The worker's request types cross Ray into the orchestrator: no torch.
    "worker_types": (
        ["specmask.gpu_worker.types", "specmask.gpu_worker.config"],
        ["torch", "transformers", "xgrammar"],
    ),
    # The orchestrator and both its front doors: no model code.
    "orchestrator": (
        [
            "specmask.orchestrator.engine",
            "specmask.orchestrator.api.grpc_server",
            "specmask.orchestrator.api.grpc_servicer",
            "specmask.orchestrator.api.http.app",
        ],
        ["torch", "transformers", "triton"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_imports_without_heavy_packages(case: str) -> None:
    modules, blocked = CASES[case]
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKER, ",".join(blocked), ",".join(modules)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
