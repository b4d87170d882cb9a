"""A SlotPool under a byte budget (kv_cache.SlotPool.max_bytes): geometric growth gives way to
the budget, and a resize past it raises instead of allocating."""

from __future__ import annotations

from typing import Any

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


# -- the pool gives back what a finished long sequence left -------------------------------------


def test_budget_shrinks_a_finished_long_sequences_capacity_for_more_slots() -> None:
    """Slots are as long as the longest sequence; once it is gone, more slots at the short
    sequences' length fit the budget the long one's capacity would have passed."""
    pool = _pool(4 * 64 * PER_POSITION)
    long_kv = SequenceKV()
    pool.bind(long_kv)
    pool.reserve(200)
    assert (pool.num_slots, pool.capacity) == (1, 200)
    long_kv.free()
    shorts = [SequenceKV() for _ in range(4)]
    for i, kv in enumerate(shorts):
        pool.bind(kv)
        keys = [torch.full((1, HEADS, 5, DIM), float(i + 1)) for _ in range(LAYERS)]
        kv.append(keys, keys)
    assert (pool.num_slots, pool.capacity) == (4, 64) and pool.nbytes() <= 4 * 64 * PER_POSITION
    assert all(torch.equal(kv.keys[1], torch.full((1, HEADS, 5, DIM), float(i + 1))) for i, kv in enumerate(shorts))
    # A static forward's bucket of slots shrinks the capacity the same way.
    pool2 = _pool(8 * 64 * PER_POSITION)
    kv = SequenceKV()
    pool2.bind(kv)
    pool2.reserve(300)
    kv.append([torch.ones(1, HEADS, 7, DIM)] * LAYERS, [torch.ones(1, HEADS, 7, DIM)] * LAYERS)
    pool2.ensure_slots(8)
    assert (pool2.num_slots, pool2.capacity) == (8, 64) and kv.length == 7


# -- sizing the budget ------------------------------------------------------------------------


def test_budget_bytes_arithmetic() -> None:
    from specmask.gpu_worker.kv_budget import budget_bytes

    gib = 1024**3
    assert budget_bytes(kv_cache_bytes=None, gpu_memory_utilization=None, device_type="cuda") is None
    assert budget_bytes(kv_cache_bytes=5 * gib, gpu_memory_utilization=None, device_type="cpu") == 5 * gib
    # 80 GiB at 0.9: 72 GiB, less 20 GiB in use after loading and 4 GiB for activations.
    kv = budget_bytes(
        kv_cache_bytes=None, gpu_memory_utilization=0.9, device_type="cuda", total_bytes=80 * gib, free_bytes=60 * gib
    )
    assert kv == int(80 * gib * 0.9) - 20 * gib - 4 * gib
    with pytest.raises(ValueError, match="leaves no KV memory"):
        budget_bytes(
            kv_cache_bytes=None,
            gpu_memory_utilization=0.3,
            device_type="cuda",
            total_bytes=80 * gib,
            free_bytes=60 * gib,
        )
    with pytest.raises(ValueError, match="--kv-cache-bytes"):
        budget_bytes(kv_cache_bytes=None, gpu_memory_utilization=0.9, device_type="cpu")


def test_admission_rule() -> None:
    from specmask.gpu_worker.kv_budget import KVBudget, longest_sequence

    budget = KVBudget(positions=4096, max_model_len=256, slack=16, min_capacity=64)
    assert budget.need(6, 20) == 64  # the pool's least capacity
    assert budget.need(150, 40) == 206
    assert budget.need(200, 10_000) == 256 + 16  # capped at the context
    assert budget.fits([64] * 64) and not budget.fits([64] * 64 + [64])
    assert not budget.fits([64] * 19 + [206]) and budget.fits([64] * 18 + [206])  # 19 x 206 = 3914
    assert budget.usage([64] * 32) == 0.5 and budget.usage([]) == 0.0
    padded = KVBudget(positions=4096, max_model_len=256, slack=16, min_capacity=64, slot_buckets=(1, 2, 4, 8, 16, 24))
    assert padded.slots(17) == 24 and padded.slots(25) == 25
    assert padded.fits([160] * 24) and not padded.fits([171] * 17)  # 17 rows take a 24-slot bucket
    assert longest_sequence(4096, slack=16, min_capacity=64, slot_buckets=(2,)) == 2048 - 16
    assert longest_sequence(63, slack=16, min_capacity=64) == 0
    with pytest.raises(ValueError, match="holds no"):
        KVBudget(positions=200, max_model_len=256, slack=16, min_capacity=64)


# -- a worker under a budget: the long request among many short ones --------------------------


def _seq(seq_id: str, prompt_len: int, max_tokens: int, k: int = 0) -> Any:
    from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams

    prompt = tuple(5 + (i * 7 + len(seq_id)) % 200 for i in range(prompt_len))
    spec = SpeculationParams(k=k, proposers=("draft_model",), draft_masking=False)
    # No stop tokens: each runs to its max_tokens.
    return NewSequence(seq_id, prompt, None, SamplingParams(max_tokens=max_tokens), spec, stop_token_ids=())


def _per_position(worker: Any) -> int:
    return int(worker.target.kv_bytes_per_token + worker.draft.kv_bytes_per_token)


def _within_budget(worker: Any) -> None:
    for runner in (worker.target, worker.draft):
        if runner.pool is not None:
            assert runner.pool.nbytes() <= runner.kv_budget_bytes, runner.name


def test_a_long_request_waits_while_63_short_ones_stream(make_worker: Any) -> None:
    """64 slots of 64 positions: 63 short sequences fit, a long one beside them does not. The
    worker refuses it with a clear error (the orchestrator keeps it queued) and every running
    sequence goes on emitting; it fits once enough have finished, and runs to its end. The
    pools never pass their budget, and after the long one, a full batch of short ones fits
    again (the pool gave its long capacity back)."""
    probe = make_worker(max_batch=64)
    per_position = _per_position(probe)
    probe.shutdown()
    worker = make_worker(max_batch=64, kv_cache_bytes=64 * 64 * per_position, max_k=2)
    budget = worker.kv_budget
    assert budget is not None and budget.positions == 64 * 64 and worker.info().kv_budget == budget
    assert worker.max_model_len == 256  # the budget holds a whole context alone: not lowered
    shorts = [_seq(f"s{i}", 6, 4 + i % 24, k=2 if i % 3 == 0 else 0) for i in range(63)]
    assert worker.add(shorts) == [None] * 63
    long_seq = _seq("long", 150, 40, k=2)
    emitted: dict[str, int] = {}
    refusals = 0
    finished: dict[str, Any] = {}
    admitted_beside = -1
    for _ in range(200):
        if "long" not in worker._seqs and "long" not in finished:
            running = worker.num_active()
            [error] = worker.add([long_seq])
            if error is None:
                admitted_beside = running
            else:
                assert "KV budget full" in error and "retry" in error
                refusals += 1
        usage = worker.kv_usage()
        assert usage is not None and 0 < usage <= 1
        started = {seq_id for seq_id in worker._seqs if emitted.get(seq_id)}
        outs = worker.step()
        if refusals and admitted_beside < 0:
            # While the long one waits, every running sequence steps (none sits it out).
            assert started <= {o.seq_id for o in outs if o.new_token_ids}, started
        for out in outs:
            emitted[out.seq_id] = emitted.get(out.seq_id, 0) + len(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.seq_id] = out
        _within_budget(worker)
        if worker.num_active() == 0:
            break
    assert refusals > 0 and 0 < admitted_beside <= 18, (refusals, admitted_beside)
    assert len(finished) == 64 and all(o.error is None for o in finished.values())
    assert emitted["long"] == 40 and all(emitted[s.seq_id] == s.sampling.max_tokens for s in shorts)
    # The pool now has the long one's capacity; a full batch of short ones fits again.
    again = [_seq(f"t{i}", 6, 3) for i in range(64)]
    assert worker.add(again) == [None] * 64
    results = {}
    for _ in range(50):
        for out in worker.step():
            if out.finish_reason is not None:
                results[out.seq_id] = out
        _within_budget(worker)
        if worker.num_active() == 0:
            break
    assert len(results) == 64 and all(o.error is None for o in results.values())


def test_a_budget_below_the_context_lowers_max_model_len(make_worker: Any) -> None:
    probe = make_worker()
    per_position = _per_position(probe)
    probe.shutdown()
    worker = make_worker(kv_cache_bytes=200 * per_position, max_k=2)
    assert worker.max_model_len == 200 - 16 and worker.info().max_model_len == 184
    [error] = worker.add([_seq("too-long", 190, 4)])
    assert error is not None and "max_model_len 184" in error
    assert worker.add([_seq("fits", 170, 100)]) == [None]  # stops at the context: LENGTH
    while worker.num_active():
        worker.step()
        _within_budget(worker)
    with pytest.raises(ValueError, match="holds no sequence"):
        make_worker(kv_cache_bytes=40 * per_position)
    with pytest.raises(ValueError, match="--kv-cache-bytes"):
        make_worker(gpu_memory_utilization=0.9)
