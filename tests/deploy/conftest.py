"""Shared fixtures for the offline deploy tests (Helm chart, Dockerfiles)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def shared_data_dir() -> Path:
    return Path(os.environ.get("SPECMASK_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def kuberay_crd_path() -> Path:
    path = shared_data_dir() / "kuberay" / "ray.io_rayclusters.yaml"
    if not path.is_file():
        pytest.skip(f"KubeRay CRD not found at {path} (set SPECMASK_SHARED_DATA)")
    return path
