"""The wheel installs one import name, `specmask`, and lives beside packages that own the
generic names it once shadowed: `proto` (proto-plus, a dependency of Google Cloud client
libraries) and `kernels` (Hugging Face's hub kernels, which transformers probes for by name).

The built wheel goes into a fresh target directory beside the real proto-plus and HF
`kernels` wheels from the package index, and a clean interpreter imports all three.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
NEIGHBOURS = ["proto-plus==1.29.0", "kernels==0.17.2"]

_PROBE = r"""
import json, sys
import proto, kernels
import specmask, specmask.proto, specmask.kernels, specmask.orchestrator.client
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2
from specmask.kernels.bitmask_reference import apply_token_bitmask_inplace
print(json.dumps({
    "proto": proto.__file__, "proto_message": hasattr(proto, "Message"),
    "kernels": kernels.__file__, "specmask": specmask.__file__,
    "specmask_kernels": specmask.kernels.__file__,
    "descriptor": mask_service_pb2.DESCRIPTOR.name,
}))
"""


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)  # type: ignore[call-overload]


def test_wheel_holds_only_the_specmask_namespace(tmp_path: Path) -> None:
    build = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=REPO_ROOT,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("specmask-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"specmask"}, tops

    site = tmp_path / "site"
    installed = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)])
    assert installed.returncode == 0, installed.stderr
    neighbours = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), *NEIGHBOURS])
    if neighbours.returncode != 0:
        pytest.skip(f"proto-plus / HF kernels not installable here (no package index): {neighbours.stderr[-300:]}")

    # Outside the checkout, with only the target directory in front of site-packages.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    probe = _run([sys.executable, "-c", _PROBE], cwd=tmp_path, env=env)
    assert probe.returncode == 0, probe.stderr[-3000:]
    out = json.loads(probe.stdout.strip().splitlines()[-1])
    assert Path(out["proto"]).parent == site / "proto" and out["proto_message"]
    assert Path(out["kernels"]).parent == site / "kernels"
    assert Path(out["specmask"]).parent == site / "specmask"
    assert Path(out["specmask_kernels"]).parent == site / "specmask" / "kernels"
    assert out["descriptor"] == "specmask/mask/v1/mask_service.proto"
