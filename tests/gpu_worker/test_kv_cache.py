"""SequenceKV handles on a SlotPool: in-place append, copy-free rollback, slots kept dense when
sequences finish; checked against plain lists of concatenated tensors over random operations."""

from __future__ import annotations

import random

import pytest
import torch

from specmask.gpu_worker.kv_cache import SequenceKV, SlotPool

LAYERS, HEADS, DIM = 3, 2, 4


def _entries(n: int, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    keys = [torch.randn(1, HEADS, n, DIM, generator=gen) for _ in range(LAYERS)]
    values = [torch.randn(1, HEADS, n, DIM, generator=gen) for _ in range(LAYERS)]
    return keys, values


def test_append_crop_matches_concatenation() -> None:
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    kv = SequenceKV()
    ref_k = [torch.empty(1, HEADS, 0, DIM) for _ in range(LAYERS)]
    ref_v = [torch.empty(1, HEADS, 0, DIM) for _ in range(LAYERS)]
    grew = 0
    for _ in range(300):
        if kv.length and rng.random() < 0.4:
            n = rng.randint(0, kv.length)  # roll back rejected drafts
            kv.crop(n)
            ref_k, ref_v = [k[:, :, :n] for k in ref_k], [v[:, :, :n] for v in ref_v]
        else:
            keys, values = _entries(rng.randint(1, 9), gen)
            before = kv.capacity
            kv.append(keys, values)
            grew += kv.capacity != before
            ref_k = [torch.cat([a, b], dim=2) for a, b in zip(ref_k, keys)]
            ref_v = [torch.cat([a, b], dim=2) for a, b in zip(ref_v, values)]
        assert kv.length == ref_k[0].shape[2] <= kv.capacity
        for a, b in zip(kv.keys + kv.values, ref_k + ref_v):
            assert torch.equal(a, b)
    assert 0 < grew < 10  # grows geometrically, not per append


def test_growth_keeps_contents_and_advance_is_bounded() -> None:
    gen = torch.Generator().manual_seed(1)
    kv = SequenceKV()
    keys, values = _entries(5, gen)
    kv.append(keys, values)
    first = kv.capacity
    assert first >= 64  # room for many steps before the next copy
    big_k, big_v = _entries(first, gen)
    kv.append(big_k, big_v)  # forces a regrow
    assert kv.capacity >= 5 + first
    assert torch.equal(kv.keys[1][:, :, :5], keys[1]) and torch.equal(kv.values[2][:, :, 5:], big_v[2])
    spare = kv.capacity - kv.length
    with pytest.raises(ValueError, match="past capacity"):
        kv.advance(spare + 1)
    kv.advance(spare)
    assert kv.length == kv.capacity
    with pytest.raises(ValueError, match="cannot crop"):
        kv.crop(kv.length + 1)
    kv.free()
    assert kv.length == kv.capacity == kv.nbytes() == 0


def test_rejects_inconsistent_entries() -> None:
    gen = torch.Generator().manual_seed(2)
    kv = SequenceKV()
    with pytest.raises(ValueError, match="first reserve"):
        kv.reserve(3)  # no buffers yet, no template to shape them
    keys, values = _entries(3, gen)
    with pytest.raises(ValueError, match="inconsistent"):
        kv.append(keys, values[:-1])
    with pytest.raises(ValueError, match="inconsistent"):
        kv.append(keys, [v[:, :, :2] for v in values])
    kv.append(keys, values)
    with pytest.raises(ValueError, match="layers"):
        kv.append(keys[:2], values[:2])


def test_shared_pool_matches_concatenation_over_join_crop_free() -> None:
    """Many sequences in one pool: appends, rollbacks, frees (slot moves) and joins in random
    order; every live sequence always reads back exactly its own concatenated entries."""
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    pool = SlotPool(LAYERS, HEADS, DIM, dtype=torch.float32, device="cpu")
    live: dict[int, tuple[SequenceKV, list[torch.Tensor], list[torch.Tensor]]] = {}
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if not live or op < 0.15:  # a sequence joins
            kv = SequenceKV()
            pool.bind(kv)
            live[next_id] = (kv, [torch.empty(1, HEADS, 0, DIM)] * LAYERS, [torch.empty(1, HEADS, 0, DIM)] * LAYERS)
            next_id += 1
            continue
        key = rng.choice(list(live))
        kv, ref_k, ref_v = live[key]
        if op < 0.25:  # it finishes: its slot is freed, the last one moves in
            kv.free()
            del live[key]
        elif op < 0.5 and kv.length:
            n = rng.randint(0, kv.length)
            kv.crop(n)
            live[key] = (kv, [k[:, :, :n] for k in ref_k], [v[:, :, :n] for v in ref_v])
        else:
            keys, values = _entries(rng.randint(1, 9), gen)
            kv.append(keys, values)
            live[key] = (
                kv,
                [torch.cat([a, b], dim=2) for a, b in zip(ref_k, keys)],
                [torch.cat([a, b], dim=2) for a, b in zip(ref_v, values)],
            )
        assert sorted(kv.slot for kv, _, _ in live.values()) == list(range(len(live))) == list(range(pool.num_used))
        for kv, ref_k, ref_v in live.values():
            assert kv.pool is pool and kv.length == ref_k[0].shape[2] <= pool.capacity
            for a, b in zip(kv.keys + kv.values, ref_k + ref_v):
                assert torch.equal(a, b)
