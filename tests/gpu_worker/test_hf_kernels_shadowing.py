"""Our top-level `kernels` package vs Hugging Face's `kernels` (hub kernels).

transformers probes for HF `kernels` by import name: `importlib.util.find_spec("kernels")`
finds OURS, then the version comes from `importlib.metadata` -- under the import
name, else via packages_distributions() (our editable install maps `kernels` to
the `specmask` distribution, so it reads specmask's version), else by importing
the package and reading `__version__`. Hub kernels count as available only for
KERNELS_MIN_VERSION <= version < KERNELS_MAX_VERSION (0.18.2 .. 0.19.0 in
transformers 5.23), so ours must never look like that: this test pins it for
both the installed (editable) and the bare-checkout case, and checks that a
Llama loads and runs with our package importable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.fixtures.tiny_models import build_tiny_model_pair

REPO_ROOT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import importlib.metadata, json, sys
import kernels
ours = kernels.__file__
import transformers, torch
from transformers.utils import import_utils as iu
out = {"ours": ours, "installed": iu.is_kernels_available(),
       "seen": list(iu._is_package_available("kernels", return_version=True))}

# Bare checkout (no dist-info for specmask): hide the metadata and probe again.
real_version = importlib.metadata.version
def version(name):
    if name in ("kernels", "specmask"):
        raise importlib.metadata.PackageNotFoundError(name)
    return real_version(name)
importlib.metadata.version = version
iu.is_kernels_available.cache_clear()
out["bare"] = iu.is_kernels_available()
out["bare_seen"] = list(iu._is_package_available("kernels", return_version=True))
importlib.metadata.version = real_version

model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
tok = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
with torch.no_grad():
    logits = model(input_ids=torch.tensor([tok.encode('{"a":1}')])).logits
out["logits_shape"] = list(logits.shape)
out["finite"] = bool(torch.isfinite(logits).all())
out["vocab"] = model.config.vocab_size
print(json.dumps(out))
"""


def test_transformers_ignores_our_kernels_package_and_loads_llama(tmp_path):
    target_dir, _ = build_tiny_model_pair(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(target_dir)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["ours"]).resolve() == REPO_ROOT / "kernels" / "__init__.py"
    # Found by name, but never mistaken for a usable HF `kernels`.
    assert out["installed"] is False and out["bare"] is False
    assert out["seen"][0] is True and out["bare_seen"][1] == "N/A"
    assert out["logits_shape"][-1] == out["vocab"] and out["finite"]
