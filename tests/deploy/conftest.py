"""Shared fixtures for the offline deploy tests (Helm chart, Dockerfiles)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.shared_data import shared_data_dir


@pytest.fixture(scope="session")
def kuberay_crd_path() -> Path:
    data = shared_data_dir()
    path = (data / "kuberay" / "ray.io_rayclusters.yaml") if data else None
    if path is None or not path.is_file():
        pytest.skip("KubeRay CRD not found (set SPECMASK_SHARED_DATA or provide ../shared/data/kuberay)")
    return path
