"""Model runner and KV caches: rollback and batching (packed and padded) are exact (float32)."""

from __future__ import annotations

import pytest
import torch

from specmask.gpu_worker.kv_cache import SequenceKV
from specmask.gpu_worker.model_runner import ForwardItem, ModelRunner

VOCAB = 97  # odd on purpose
ATOL = 1e-5  # float32: batched and unbatched differ only by summation order
# How a runner batches: one forward per sequence (the reference), padded [R, T_max], packed [1, Σ T_r].
LAYOUTS = {
    "per_sequence": dict(batched=False),
    "padded": dict(batched=True, packed=False),
    "packed": dict(batched=True, packed=True),
}


def _tiny_llama(kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.gpu_worker.helpers import torch_threads

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
    )
    with torch.random.fork_rng(devices=[]), torch_threads(1):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return _tiny_llama(kv_heads=2)  # grouped-query attention


@pytest.fixture(scope="module")
def mha_model():
    return _tiny_llama(kv_heads=4)  # one KV head per query head


def _fresh_logits(model, ids: list[int]) -> torch.Tensor:  # [len(ids), V]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_incremental_forward_matches_fresh_forward(model, layout):
    runner = ModelRunner(model, **LAYOUTS[layout])
    ids = _ids(20, 1)
    kv = SequenceKV()
    runner.forward([ForwardItem(kv, ids[:7], 0)])
    got = runner.forward([ForwardItem(kv, ids[7:12], 5)])[0]
    got2 = runner.forward([ForwardItem(kv, ids[12:], 8)])[0]
    fresh = _fresh_logits(model, ids)
    torch.testing.assert_close(got, fresh[7:12], atol=ATOL, rtol=0)
    torch.testing.assert_close(got2, fresh[12:], atol=ATOL, rtol=0)
    assert kv.length == 20


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cropped_cache_gives_fresh_forward_logits(model, layout):
    """Roll back rejected drafts, feed different tokens: same logits as a fresh forward."""
    runner = ModelRunner(model, **LAYOUTS[layout])
    committed, rejected, other = _ids(11, 2), _ids(4, 3), _ids(3, 4)
    kv = SequenceKV()
    runner.forward([ForwardItem(kv, committed[:-1], 0)])
    runner.forward([ForwardItem(kv, [committed[-1], *rejected], 5)])  # verify-style forward
    assert kv.length == 15
    kv.crop(11)  # keep the committed tokens only
    assert kv.length == 11 and all(k.shape[2] == 11 for k in kv.keys + kv.values)
    got = runner.forward([ForwardItem(kv, other, 3)])[0]
    fresh = _fresh_logits(model, committed + other)
    torch.testing.assert_close(got, fresh[-3:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("gqa", [True, False], ids=["gqa", "mha"])
def test_batched_forward_matches_per_sequence_forwards(model, mha_model, packed, gqa):
    """Ragged batch: different cache lengths (including empty) and new-token counts,
    among them a prefill-sized row beside one-token rows."""
    model = model if gqa else mha_model
    batched, single = ModelRunner(model, batched=True, packed=packed), ModelRunner(model, batched=False)
    shapes = [(0, 3), (9, 1), (17, 5), (4, 2), (1, 1), (0, 40)]  # (cached length, new tokens)
    seqs = [_ids(p + n, 10 + i) for i, (p, n) in enumerate(shapes)]
    kv_b = [SequenceKV() for _ in seqs]
    kv_s = [SequenceKV() for _ in seqs]
    for kvs, runner in ((kv_b, batched), (kv_s, single)):
        runner.forward([ForwardItem(kv, s[:p], 0) for kv, s, (p, _) in zip(kvs, seqs, shapes) if p])
    computed = batched.num_computed_positions
    out_b = batched.forward([ForwardItem(kv, s[p:], n) for kv, s, (p, n) in zip(kv_b, seqs, shapes)])
    # Packed: only the real tokens go through the layers; padded: every row is as wide as the widest.
    real = sum(n for _, n in shapes)
    assert batched.num_computed_positions - computed == (real if packed else len(shapes) * 40)
    out_s = single.forward([ForwardItem(kv, s[p:], n) for kv, s, (p, n) in zip(kv_s, seqs, shapes)])
    for (p, n), a, b, s, ka, kb in zip(shapes, out_b, out_s, seqs, kv_b, kv_s):
        assert a.shape == (n, VOCAB)
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
        torch.testing.assert_close(a, _fresh_logits(model, s)[p:], atol=ATOL, rtol=0)
        assert ka.length == kb.length == p + n
        for x, y in zip(ka.keys + ka.values, kb.keys + kb.values):
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
    # Every sequence's KV is one row of the runner's pool: dense, distinct slots.
    assert sorted(kv.slot for kv in kv_b) == list(range(len(seqs))) and batched.pool.num_used == len(seqs)
    for kv in kv_b:
        assert kv.pool is batched.pool
        assert kv.buffers()[0][0].data_ptr() == batched.pool.k[0][kv.slot].data_ptr()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_subset_batches_and_freed_slots_keep_every_sequence_exact(model, packed):
    """A forward over some of the pool's sequences (the others sit in the attended row range as
    dummy rows, which must not disturb them), and a freed middle slot (the last sequence moves
    into it)."""
    runner = ModelRunner(model, batched=True, packed=packed)
    seqs = [_ids(30, 40 + i) for i in range(4)]
    kvs = [SequenceKV() for _ in seqs]
    runner.forward([ForwardItem(kv, s[: 5 + i], 0) for i, (kv, s) in enumerate(zip(kvs, seqs))])
    # Rows 2 and 0 only (items in any order): row 1 is inside the range and must come out untouched.
    before = [t.clone() for t in kvs[1].keys + kvs[1].values]
    whole_row = [t.clone() for t in kvs[1].buffers()[0] + kvs[1].buffers()[1]]
    out = runner.forward([ForwardItem(kvs[2], seqs[2][7:8], 1), ForwardItem(kvs[0], seqs[0][5:9], 4)])
    torch.testing.assert_close(out[1], _fresh_logits(model, seqs[0][:9])[5:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[0], _fresh_logits(model, seqs[2][:8])[7:8], atol=ATOL, rtol=0)
    for a, b in zip(kvs[1].keys + kvs[1].values, before):
        assert torch.equal(a, b)
    if packed:  # a packed forward writes nothing at all into a dummy row (padded: past its length)
        for a, b in zip(kvs[1].buffers()[0] + kvs[1].buffers()[1], whole_row):
            assert torch.equal(a, b)
    kvs[1].free()  # slot 1 freed: the sequence in slot 3 moves there
    assert kvs[3].slot == 1 and runner.pool.num_used == 3 and kvs[1].pool is None
    items = [ForwardItem(kvs[i], seqs[i][kvs[i].length : kvs[i].length + 2], 2) for i in (0, 2, 3)]
    lengths = [kvs[i].length for i in (0, 2, 3)]
    out = runner.forward(items)
    for i, got, n in zip((0, 2, 3), out, lengths):
        torch.testing.assert_close(got, _fresh_logits(model, seqs[i][: n + 2])[n:], atol=ATOL, rtol=0)


def test_only_requested_logit_rows(model):
    runner = ModelRunner(model)
    kvs = [SequenceKV(), SequenceKV()]
    out = runner.forward([ForwardItem(kvs[0], _ids(6, 5), 0), ForwardItem(kvs[1], _ids(4, 6), 2)])
    assert out[0].shape == (0, VOCAB) and out[1].shape == (2, VOCAB)
    assert out[1].dtype == torch.float32


def test_rejects_bad_items(model):
    runner = ModelRunner(model)
    with pytest.raises(ValueError, match="max length"):
        runner.forward([ForwardItem(SequenceKV(), _ids(65, 7), 1)])
    with pytest.raises(ValueError, match="bad forward item"):
        runner.forward([ForwardItem(SequenceKV(), [], 0)])
    kv = SequenceKV()
    runner.forward([ForwardItem(kv, [1, 2, 3], 0)])
    with pytest.raises(ValueError, match="cannot crop"):
        kv.crop(4)


@pytest.mark.parametrize("layout", [*LAYOUTS, "static", "static_bucketed"])
def test_device_tail_is_the_same_forward_as_host_tokens(model, layout: str) -> None:
    """Tokens given as a device tail (``DeviceTail``: the device draft loop's drafts, rows of a shared
    [n, K] tensor at any column offset) after a row's host tokens, or as a whole row, are the same
    forward as those tokens given on the host: the same logits and the same cache entries."""
    from specmask.gpu_worker.model_runner import DeviceTail

    def runner() -> ModelRunner:
        if layout.startswith("static"):
            r = ModelRunner(model, static="on")
            assert r.static is not None
            r.static.pad_to_buckets = layout == "static_bucketed"
            return r
        return ModelRunner(model, **LAYOUTS[layout])

    prompts = [_ids(6 + 2 * i, 40 + i) for i in range(4)]
    table = torch.tensor([_ids(5, 60 + i) for i in range(4)], dtype=torch.int64)  # [n = 4, K = 5] "drafts"
    # Per row: (host tokens of the prompt left uncached, tail start column, tail length).
    rows = [(1, 0, 3), (2, 1, 4), (0, 4, 1), (1, 2, 2)]
    results = []
    for tail in (False, True):
        r = runner()
        kvs = [SequenceKV() for _ in prompts]
        r.forward([ForwardItem(kv, p[: len(p) - h], 0) for kv, p, (h, _, _) in zip(kvs, prompts, rows) if len(p) > h])
        items = []
        for i, (kv, p, (h, start, count)) in enumerate(zip(kvs, prompts, rows)):
            host = p[len(p) - h :]
            drafts = table[i, start : start + count].tolist()
            if tail:
                items.append(ForwardItem(kv, host, count + 1 - (h == 0), DeviceTail(table, i, start, count)))
            else:
                items.append(ForwardItem(kv, [*host, *drafts], count + 1 - (h == 0)))
        logits = r.forward(items)
        # One more forward on top: the caches hold the same entries either way.
        after = r.forward([ForwardItem(kv, [7], 1) for kv in kvs])
        results.append((logits, after, [kv.length for kv in kvs]))
    (want, want_after, want_len), (got, got_after, got_len) = results
    assert got_len == want_len
    for w, g in zip([*want, *want_after], [*got, *got_after], strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def test_empty_device_tail_is_refused(model) -> None:
    from specmask.gpu_worker.model_runner import DeviceTail

    kv = SequenceKV()
    with pytest.raises(ValueError, match="device tail"):
        ModelRunner(model).forward([ForwardItem(kv, [1], 1, DeviceTail(torch.zeros(1, 2, dtype=torch.int64), 0, 0, 0))])
