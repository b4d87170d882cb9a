"""Fixtures for worker tests: a tiny random-init model pair, a live mask service on
127.0.0.1:0, and a worker factory. Everything runs on CPU in float32."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    from tests.gpu_worker.helpers import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target_dir, draft_dir): random-init Llama pair sharing a byte-level BPE (EOS id 0)."""
    from tests.fixtures.tiny_models import build_tiny_model_pair
    from tests.gpu_worker.helpers import torch_threads

    with torch.random.fork_rng(devices=[]), torch_threads(1):
        return build_tiny_model_pair(tmp_path_factory.mktemp("tiny-pair"), max_position_embeddings=256)


@pytest.fixture(scope="session")
def mask_service(tiny_pair: tuple[Path, Path]) -> Iterator[Any]:
    """A real mask service serving the tiny pair's tokenizer."""
    from tests.gpu_worker.helpers import serving_masks

    with serving_masks(tiny_pair[0]) as handle:
        yield handle


@pytest.fixture(scope="session")
def mask_address(mask_service: Any) -> str:
    return f"127.0.0.1:{mask_service.port}"


@pytest.fixture()
def make_worker(tiny_pair: tuple[Path, Path], mask_address: str) -> Iterator[Callable[..., Any]]:
    """make_worker(**WorkerConfig overrides) -> GpuWorker on the tiny pair; shut down after the test."""
    from specmask.gpu_worker.actor import GpuWorker
    from specmask.gpu_worker.config import WorkerConfig

    made: list[GpuWorker] = []

    def make(**overrides: Any) -> GpuWorker:
        fields: dict[str, Any] = dict(
            target_dir=str(tiny_pair[0]),
            draft_dir=str(tiny_pair[1]),
            device="cpu",
            dtype="float32",
            mask_service_addresses=(mask_address,),
            mask_deadline_s=20.0,
        )
        fields.update(overrides)
        worker = GpuWorker(WorkerConfig(**fields))
        made.append(worker)
        return worker

    yield make
    for w in made:
        w.shutdown()
