"""WorkerConfig.torch_threads: 0 means every CPU of a CPU worker's process for a real model (Ray
alone gives one), one thread for a tiny one."""

from __future__ import annotations

import os

import pytest
import torch

from specmask.gpu_worker.config import WorkerConfig
from specmask.gpu_worker.loading import MIN_PARAMS_FOR_THREADS, cpu_threads

REAL = 134_515_008  # SmolLM2-135M-Instruct's parameters


def test_zero_means_every_cpu_of_this_process_for_a_real_model_on_the_cpu() -> None:
    assert cpu_threads(0, torch.device("cpu"), REAL) == len(os.sched_getaffinity(0))


def test_a_tiny_model_keeps_one_thread() -> None:
    """Its ops are too small to split: a second thread only spin-waits on a shared box."""
    assert cpu_threads(0, torch.device("cpu"), MIN_PARAMS_FOR_THREADS - 1) == 1


def test_a_gpu_worker_keeps_its_default_and_explicit_values_pass_through() -> None:
    assert cpu_threads(0, torch.device("cuda"), REAL) is None  # building the device needs no CUDA
    assert cpu_threads(None, torch.device("cpu"), REAL) is None
    assert cpu_threads(3, torch.device("cpu"), 1_000) == 3


def test_negative_is_refused() -> None:
    with pytest.raises(ValueError, match="torch_threads"):
        WorkerConfig(target_dir="/m", torch_threads=-1)
