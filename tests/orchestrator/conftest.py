"""Fixtures for orchestrator unit tests: a small byte-level BPE tokenizer and an in-process mask service."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.shared_data import shared_data_dir
from tests.fixtures.tokenizers import build_bpe_tokenizer


@pytest.fixture(scope="session")
def shared_tokenizers() -> Path:
    data = shared_data_dir()
    if data is None or not (data / "tokenizers").is_dir():
        pytest.skip("shared tokenizers not found (set SPECMASK_SHARED_DATA or provide ../shared/data)")
    return data / "tokenizers"


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bpe_tokenizer(tmp_path_factory.mktemp("orch-bpe"))


@pytest.fixture(scope="session")
def bpe_tokenizer(bpe_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def mask_service_address(bpe_dir: Path) -> Iterator[str]:
    """A real mask service (in-process gRPC server on 127.0.0.1:0) serving the BPE tokenizer."""
    from specmask.mask_service.server.config import MaskServiceConfig
    from specmask.mask_service.server.server import build_service
    from specmask.mask_service.server.tokenizers import TokenizerSource

    handle = build_service(
        MaskServiceConfig(tokenizers=(TokenizerSource(str(bpe_dir)),), host="127.0.0.1", port=0, mask_threads=1)
    )
    handle.server.start()
    yield f"127.0.0.1:{handle.port}"
    handle.stop(grace_s=1.0)
