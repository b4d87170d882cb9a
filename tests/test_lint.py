"""The tree is lint-clean and formatted: ruff (version pinned in pyproject's dev extra) with the
rules chosen in pyproject.toml. Generated stubs (proto/gen) are excluded there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "args", [["check", "--no-cache"], ["format", "--check", "--no-cache"]], ids=["check", "format"]
)
def test_ruff(args: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "."], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"ruff {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
