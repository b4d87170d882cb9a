"""Sizing a worker's KV budget from its config and its loaded models (gpu_worker.kv_budget).

The budget in bytes (``kv_cache_bytes``, or a share of the GPU's memory) is split between
the target's and the draft's pools by their bytes per position. A budget too small for a
``max_model_len`` sequence alone lowers the worker's max_model_len to the longest that fits
(with a warning), so a request that could never fit is refused by the context check.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from specmask.gpu_worker.config import WorkerConfig
from specmask.gpu_worker.kv_budget import KVBudget, budget_bytes, longest_sequence
from specmask.gpu_worker.kv_cache import MIN_CAPACITY
from specmask.gpu_worker.model_runner import ModelRunner
from specmask.gpu_worker.static_forward import BATCH_BUCKETS, WIDTH_BUCKETS

logger = logging.getLogger(__name__)


def size_kv_budget(
    config: WorkerConfig, device: torch.device, runners: Sequence[ModelRunner], max_model_len: int
) -> tuple[KVBudget | None, int]:
    """The KV budget (None = unbounded) and the max_model_len it leaves; sets each runner's
    ``kv_budget_bytes``, its pool's share. Raises ValueError for a budget that holds no
    sequence at all."""
    total = free = 0
    if config.gpu_memory_utilization is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    nbytes = budget_bytes(
        kv_cache_bytes=config.kv_cache_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        device_type=device.type,
        total_bytes=total,
        free_bytes=free,
    )
    if nbytes is None:
        return None, max_model_len
    per_position = sum(r.kv_bytes_per_token for r in runners)
    positions = nbytes // per_position
    # A static forward on a GPU pads its batch to a bucket of slots; every forward writes up
    # to a verify row's k + 1 positions, or a static width bucket's, past a row's length.
    padded = any(r.static is not None and r.static.pad_to_buckets for r in runners)
    buckets = BATCH_BUCKETS if padded else ()
    slack = max(config.max_k + 1, WIDTH_BUCKETS[-1])
    longest = longest_sequence(positions, slack=slack, min_capacity=MIN_CAPACITY, slot_buckets=buckets)
    if longest < 2:
        raise ValueError(
            f"a KV budget of {nbytes} bytes ({positions} positions of {per_position} bytes) holds no "
            f"sequence: one needs at least {max(MIN_CAPACITY, 2 + slack)} positions"
        )
    if longest < max_model_len:
        logger.warning(
            "the KV budget (%d bytes, %d positions) holds one sequence of at most %d tokens: "
            "max_model_len lowered from %d",
            nbytes,
            positions,
            longest,
            max_model_len,
        )
        max_model_len = longest
    for runner in runners:
        runner.kv_budget_bytes = positions * runner.kv_bytes_per_token
    budget = KVBudget(positions, max_model_len, slack, MIN_CAPACITY, buckets)
    logger.info(
        "KV budget: %d bytes, %d slot-positions (%d bytes each, target and draft), e.g. %d sequences of %d",
        nbytes,
        positions,
        per_position,
        positions // budget.need(max_model_len, 0),
        max_model_len,
    )
    return budget, max_model_len
