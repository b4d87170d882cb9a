"""Fixtures for mask-service tests: a small trained BPE tokenizer and live servers on 127.0.0.1:0."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.mask_service.client.mask_client import MaskServiceClient
from specmask.mask_service.server.server import MaskServiceHandle, build_service
from specmask.mask_service.server.tokenizers import TokenizerRegistry, TokenizerSource
from tests.fixtures.shared_data import shared_data_dir
from tests.fixtures.tokenizers import build_bpe_tokenizer
from tests.mask_service.service_config import make_config


@pytest.fixture(scope="session")
def shared_data() -> Path:
    p = shared_data_dir()
    if p is None:
        pytest.skip("shared data not found (set SPECMASK_SHARED_DATA or provide ../shared/data)")
    return p


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="session")
def bpe_id(bpe_dir: Path) -> str:
    return tokenizer_id_for_path(bpe_dir)


@pytest.fixture(scope="session")
def hf_tok(bpe_dir: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def registry(bpe_dir: Path) -> TokenizerRegistry:
    return TokenizerRegistry([TokenizerSource(str(bpe_dir))])


@pytest.fixture(scope="session")
def service(bpe_dir: Path, registry: TokenizerRegistry) -> Iterator[MaskServiceHandle]:
    handle = build_service(make_config(bpe_dir, max_sessions=200, max_batch=64, max_k=8), registry)
    handle.server.start()
    yield handle
    handle.stop(grace_s=1.0)


@pytest.fixture()
def client(service: MaskServiceHandle) -> Iterator[MaskServiceClient]:
    # 120 s: a new grammar is compiled twice (a killable trial, then in-process), and some
    # accepted test grammars take tens of seconds on a loaded 2-core box.
    c = MaskServiceClient(f"127.0.0.1:{service.port}", deadline_s=120.0)
    yield c
    c.close()
