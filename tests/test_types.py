"""mypy over the production packages, with the configuration in pyproject.toml ([tool.mypy]).

The seams between packages and processes are typed (Protocols in specmask/mask_service/protocols.py,
the proto enums' value types, kernels.backend.Backend); this keeps them checked, and
``warn_unused_ignores`` makes a ``# type: ignore`` that no longer hides anything fail here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every `# type: ignore[...]` in the checked packages says why on the same line.
_IGNORE = re.compile(r"#\s*type:\s*ignore\[[^\]]+\](.*)$")
_CHECKED = ("specmask", "bench")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # a cold cache on a busy 2-core box takes minutes
def test_mypy_reports_no_errors() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Incremental cache under the repository (.gitignore'd): a rerun checks only what changed.
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, f"mypy found problems:\n{proc.stdout}{proc.stderr}"
    assert "Success: no issues found" in proc.stdout, proc.stdout


def test_every_type_ignore_says_why() -> None:
    bare = []
    for package in _CHECKED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "gen" in path.relative_to(ROOT).parts:
                continue  # generated protobuf code
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                match = _IGNORE.search(line)
                if match and not match.group(1).strip().startswith("#"):
                    bare.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not bare, "type: ignore without a reason on its line:\n" + "\n".join(bare)
