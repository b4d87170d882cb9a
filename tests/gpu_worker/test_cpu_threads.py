"""WorkerConfig.torch_threads: 0 means every CPU of a CPU worker's process (Ray alone gives one)."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.loading import cpu_threads


def test_zero_means_every_cpu_of_this_process_on_a_cpu_device() -> None:
    assert cpu_threads(0, torch.device("cpu")) == len(os.sched_getaffinity(0))


def test_a_gpu_worker_keeps_its_default_and_explicit_values_pass_through() -> None:
    assert cpu_threads(0, torch.device("cuda")) is None  # building the device needs no CUDA
    assert cpu_threads(None, torch.device("cpu")) is None
    assert cpu_threads(3, torch.device("cpu")) == 3


def test_negative_is_refused() -> None:
    with pytest.raises(ValueError, match="torch_threads"):
        WorkerConfig(target_dir="/m", torch_threads=-1)
