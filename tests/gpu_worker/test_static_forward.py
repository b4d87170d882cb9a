"""The static-shape forward (gpu_worker.static_forward) equals the eager packed forward.

On a CPU the static path runs eagerly, either at the exact batch range or padded to its
buckets (the layout a CUDA graph records: dummy rows, padded columns); both must give
the eager path's logits (float32, up to summation order). Through the whole worker the
static path is checked against the greedy reference in test_greedy_equivalence.py.
"""

from __future__ import annotations

import pytest
import torch

from specmask.gpu_worker.kv_cache import SequenceKV
from specmask.gpu_worker.model_runner import ForwardItem, ModelRunner
from specmask.gpu_worker.static_forward import StaticForward, build, supports

VOCAB = 97
ATOL = 1e-5


def _tiny_llama(kv_heads: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _drive(runner: ModelRunner, steps: int = 6) -> list[torch.Tensor]:
    """Prefill 5 sequences, then decode/verify steps of mixed widths over a subset of them, with
    rollbacks (crops) and a sequence freed midway (its slot refilled by the last one)."""
    kvs = [SequenceKV() for _ in range(5)]
    out: list[torch.Tensor] = []
    out += runner.forward([ForwardItem(kv, _ids(9 + 3 * i, i), 1) for i, kv in enumerate(kvs)])
    for step in range(steps):
        if step == 3:
            kvs[1].free()
            kvs.pop(1)
        live = kvs if step % 2 == 0 else kvs[::2]  # odd steps leave rows out: dummy rows in the range
        items = [
            ForwardItem(kv, _ids(1 + (i + step) % 5, 100 * step + i), 1 + (i + step) % 5) for i, kv in enumerate(live)
        ]
        out += runner.forward(items)
        for i, kv in enumerate(live):
            kv.crop(kv.length - (i + step) % 3)  # reject some drafts
    return out


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["mqa", "gqa", "mha"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return _tiny_llama(kv_heads=request.param)


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "bucketed"])
def test_static_forward_matches_eager(model: torch.nn.Module, padded: bool) -> None:
    eager = ModelRunner(model)
    static = ModelRunner(model, static="on")
    assert static.static is not None and eager.static is None
    static.static.pad_to_buckets = padded
    want, got = _drive(eager), _drive(static)
    assert static.static.forwards > 0  # the decode/verify steps took the static path
    assert len(want) == len(got)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_wide_forwards_fall_back_to_eager(model: torch.nn.Module) -> None:
    runner = ModelRunner(model, static="on")
    assert runner.static is not None
    kv = SequenceKV()
    runner.forward([ForwardItem(kv, _ids(40, 7), 1)])  # a prefill wider than every width bucket
    assert runner.static.forwards == 0 and kv.length == 40
    runner.forward([ForwardItem(kv, _ids(3, 8), 3)])
    assert runner.static.forwards == 1 and kv.length == 43


def test_bucketed_plan_pads_rows_and_width(model: torch.nn.Module) -> None:
    runner = ModelRunner(model, static="on")
    assert runner.static is not None
    static: StaticForward = runner.static
    kvs = [SequenceKV() for _ in range(3)]
    runner.forward([ForwardItem(kv, [1, 2], 1) for kv in kvs])
    static.pad_to_buckets = True
    assert static.plan([ForwardItem(kvs[2], [1, 2, 3], 3)]) == (4, 4)  # slot 2 -> 3 rows -> bucket 4
    static.pad_to_buckets = False
    assert static.plan([ForwardItem(kvs[2], [1, 2, 3], 3)]) == (3, 3)
    assert static.plan([ForwardItem(kvs[0], list(range(17)), 1)]) is None


def test_modes_and_cpu_defaults(model: torch.nn.Module) -> None:
    assert supports(model)
    runner = ModelRunner(model, static="auto")
    assert runner.static is not None and not runner.static.use_graphs and not runner.static.pad_to_buckets
    assert ModelRunner(model, static="off").static is None
    assert ModelRunner(model).static is None
    with pytest.raises(ValueError):
        StaticForward(model, use_graphs=True)  # no CUDA here


def test_unsupported_architecture_falls_back_under_auto_only() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=64)).eval()
    assert not supports(gpt2)
    assert build(gpt2, "auto") is None and build(gpt2, "off") is None
    with pytest.raises(ValueError):
        build(gpt2, "on")
