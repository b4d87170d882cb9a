"""Config builder shared by the mask-service tests (importable, unlike conftest)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc

from specmask.mask_service.client.mask_client import MaskServiceClient, MaskServiceError
from specmask.mask_service.server.config import MaskServiceConfig
from specmask.mask_service.server.tokenizers import TokenizerSource


def make_config(bpe_dir: Path, **overrides: object) -> MaskServiceConfig:
    """A loopback, port-0 config over the test BPE tokenizer; keyword overrides win."""
    # A generous compile budget: the grammar tests check what the engine accepts, not how
    # fast a shared, loaded 2-core box compiles it (a 12,000-repetition pattern took 105 s
    # at load 20). Tests of the budget itself (test_mask_compile_pool) set their own.
    base: dict[str, object] = dict(
        tokenizers=(TokenizerSource(str(bpe_dir)),),
        host="127.0.0.1",
        port=0,
        mask_threads=2,
        compile_timeout_s=300.0,
        compile_workers=1,
    )
    base.update(overrides)
    return MaskServiceConfig(**base)  # type: ignore[arg-type]  # the dataclass checks the fields


def open_session_retrying(client: MaskServiceClient, tokenizer_id: str, spec: Any, budget_s: float = 600.0) -> str:
    """OpenSession as a client must call it: a grammar still compiling when the call's wait ends is
    answered RESOURCE_EXHAUSTED ("still compiling, retry shortly"; a busy box stretches a compile
    far past its CPU budget in wall time), and is retried until it compiles or is refused."""
    deadline = time.monotonic() + budget_s
    while True:
        try:
            return client.open_session(tokenizer_id, spec)
        except MaskServiceError as exc:
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(1.0)
