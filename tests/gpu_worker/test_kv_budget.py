"""A SlotPool under a byte budget (kv_cache.SlotPool.max_bytes): geometric growth gives way to
the budget, and a resize past it raises instead of allocating."""

from __future__ import annotations

import pytest
import torch

from specmask.gpu_worker.kv_cache import KVBudgetExceeded, SequenceKV, SlotPool, kv_bytes_per_token

LAYERS, HEADS, DIM = 2, 2, 4
PER_POSITION = kv_bytes_per_token(LAYERS, HEADS, DIM, torch.float32)  # 2 * 2 * 2 * 4 * 4 = 128


def _pool(max_bytes: int | None) -> SlotPool:
    return SlotPool(LAYERS, HEADS, DIM, dtype=torch.float32, device="cpu", max_bytes=max_bytes)


def test_bytes_per_token() -> None:
    assert PER_POSITION == 128
    # Llama-3.1-8B in bfloat16: 32 layers x 8 KV heads x 128 dims, keys and values.
    assert kv_bytes_per_token(32, 8, 128, torch.bfloat16) == 128 * 1024


def test_unbounded_pool_grows_geometrically() -> None:
    pool = _pool(None)
    pool.grow(2, 100)
    pool.grow(2, 101)
    assert pool.capacity == 164  # by half, at least _MIN_GROWTH (64)


def test_budget_clamps_geometric_growth() -> None:
    pool = _pool(2 * 120 * PER_POSITION)  # two slots of 120 positions
    pool.grow(2, 100)
    assert (pool.num_slots, pool.capacity) == (2, 100)
    pool.grow(2, 101)  # geometric would be 164 positions: past the budget, so exactly what was asked
    assert (pool.num_slots, pool.capacity) == (2, 101)
    assert pool.nbytes() <= 2 * 120 * PER_POSITION
    with pytest.raises(KVBudgetExceeded, match="exceeds its budget"):
        pool.grow(2, 121)
    assert (pool.num_slots, pool.capacity) == (2, 101)  # nothing was allocated or lost


def test_budget_refuses_a_slot_past_it_and_keeps_the_data() -> None:
    pool = _pool(2 * 64 * PER_POSITION)
    kvs = [SequenceKV() for _ in range(2)]
    for i, kv in enumerate(kvs):
        pool.bind(kv)
        keys = [torch.full((1, HEADS, 3, DIM), float(i + 1)) for _ in range(LAYERS)]
        kv.append(keys, keys)
    with pytest.raises(KVBudgetExceeded):
        pool.bind(SequenceKV())
    assert pool.num_used == 2 and all(
        torch.equal(kv.keys[0], torch.full((1, HEADS, 3, DIM), float(i + 1))) for i, kv in enumerate(kvs)
    )
    assert pool.fits(2, 64) and not pool.fits(3, 64) and not pool.fits(2, 65)


def test_runner_pool_takes_the_budget() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from specmask.gpu_worker.model_runner import ForwardItem, ModelRunner

    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=DIM, max_position_embeddings=512,
    )  # fmt: skip
    runner = ModelRunner(LlamaForCausalLM(config).eval())
    assert runner.kv_bytes_per_token == PER_POSITION
    runner.kv_budget_bytes = 100 * PER_POSITION
    kv = SequenceKV()
    runner.forward([ForwardItem(kv, [i % 50 for i in range(90)], 1)])
    assert runner.pool is not None and runner.pool.nbytes() <= 100 * PER_POSITION
    with pytest.raises(KVBudgetExceeded):
        runner.forward([ForwardItem(kv, list(range(11)), 1)])
