"""The CLI as processes (`specmask up`, `specmask orchestrator`, `specmask serve`): no shared stack,
each test starts its own, so these run apart from tests/e2e's stack package."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    return build_tiny_model_pair(tmp_path_factory.mktemp("cli-tiny"))
