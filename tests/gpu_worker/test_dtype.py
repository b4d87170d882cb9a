"""``--dtype auto`` (loading.resolve_dtype): the checkpoint's dtype on CUDA, float32 elsewhere.

The CUDA branch is a function of the device type, so it is checked here without a GPU."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from specmask.gpu_worker.config import DTYPES, WorkerConfig
from specmask.gpu_worker.loading import checkpoint_dtype, resolve_dtype


def _checkpoint(tmp_path: Path, config: dict[str, object]) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("config", "recorded"),
    [
        ({"model_type": "qwen3", "torch_dtype": "bfloat16"}, "bfloat16"),  # transformers 4 writes torch_dtype
        ({"model_type": "llama", "dtype": "float16"}, "float16"),  # transformers 5 writes dtype
        ({"model_type": "gemma3", "text_config": {"dtype": "bfloat16"}}, "bfloat16"),
        ({"model_type": "gpt2"}, None),
    ],
)
def test_checkpoint_dtype(tmp_path: Path, config: dict[str, object], recorded: str | None) -> None:
    assert checkpoint_dtype(_checkpoint(tmp_path, config)) == recorded


def test_checkpoint_dtype_of_a_dir_without_config(tmp_path: Path) -> None:
    assert checkpoint_dtype(str(tmp_path)) is None


@pytest.mark.parametrize(
    ("device", "recorded", "want"),
    [
        ("cuda", "bfloat16", torch.bfloat16),
        (torch.device("cuda", 1), "bfloat16", torch.bfloat16),
        ("cuda", "float16", torch.float16),
        ("cuda", "float32", torch.float32),
        ("cuda", None, torch.float32),  # nothing recorded: transformers' own default
        ("cuda", "int8", torch.float32),  # not a floating dtype: never loaded as one
        ("cuda", "no_such_dtype", torch.float32),
        ("cpu", "bfloat16", torch.float32),  # exact greedy, and what CPU kernels are fast at
        ("mps", "bfloat16", torch.float32),
    ],
)
def test_auto(device: str | torch.device, recorded: str | None, want: torch.dtype) -> None:
    assert resolve_dtype("auto", device, recorded) is want


@pytest.mark.parametrize(
    ("name", "want"), [("bfloat16", torch.bfloat16), ("half", torch.float16), ("float", torch.float32)]
)
def test_explicit_names_win_on_every_device(name: str, want: torch.dtype) -> None:
    for device in ("cpu", "cuda"):
        assert resolve_dtype(name, device, "float16") is want


@pytest.mark.parametrize("name", ["int8", "bool", "Auto", "", "tensor"])
def test_bad_names(name: str) -> None:
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype(name, "cuda", "bfloat16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        WorkerConfig(target_dir="x", dtype=name)


def test_defaults_are_auto() -> None:
    from specmask.orchestrator.config import OrchestratorConfig
    from specmask.orchestrator.main import add_arguments

    assert WorkerConfig(target_dir="x").dtype == "auto"
    assert OrchestratorConfig(target_dir="x", mask_service_addresses=("127.0.0.1:1",)).worker_config().dtype == "auto"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    needed = ["--target", "t", "--mask-service", "127.0.0.1:1"]
    assert parser.parse_args(needed).dtype == "auto"
    assert parser.parse_args([*needed, "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args([*needed, "--dtype", "int8"])
    assert set(DTYPES) >= {"auto", "bfloat16", "float16", "float32"}
