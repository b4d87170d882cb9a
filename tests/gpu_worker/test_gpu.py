"""On CUDA: the worker (models, Triton kernels) reproduces plain constrained greedy decoding."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import run_to_completion, torch_threads
from tests.gpu_worker.reference import compile_grammar, greedy_constrained
from tests.gpu_worker.test_static_forward import VOCAB, _tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"mode": {"type": "string", "enum": ["on", "off"]}, "n": {"type": "integer"}},
        "required": ["mode", "n"],
        "additionalProperties": False,
    }
)


@pytest.mark.parametrize("k", [0, 4])
def test_cuda_worker_matches_cpu_reference(make_worker, tiny_pair, k):
    worker = make_worker(device="cuda")
    assert worker.info().device.startswith("cuda")
    prompt = [5, 6, 7]
    spec = SpeculationParams(k=k, proposers=("draft_model", "grammar_forced", "ngram"))
    seqs = [
        NewSequence(
            "g", tuple(prompt), GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA), SamplingParams(max_tokens=40), spec
        ),
        NewSequence("p", tuple(prompt), None, SamplingParams(max_tokens=20), spec),
    ]
    assert worker.add(seqs) == [None, None]
    results = run_to_completion(worker)
    with torch_threads(1):
        ref_g = greedy_constrained(
            tiny_pair[0], prompt, compile_grammar(tiny_pair[0], "json_schema", SCHEMA, (0,)), (0,), 40
        )
        ref_p = greedy_constrained(tiny_pair[0], prompt, None, (0,), 20)
    assert results["g"].tokens == ref_g.tokens
    assert results["p"].tokens == ref_p.tokens
    assert results["p"].finish in (FinishReason.LENGTH, FinishReason.STOP)


def _grow_and_decode(runner: Any, kvs: list[Any]) -> list[torch.Tensor]:
    """Decode one sequence alone (a graph per shape at B=1), then add sequences one at a time,
    each new slot growing the pool's tensors (every captured graph dropped and recaptured)."""
    from specmask.gpu_worker.model_runner import ForwardItem

    out: list[torch.Tensor] = []
    for n in range(1, len(kvs) + 1):
        out += runner.forward([ForwardItem(kvs[n - 1], [(7 * n + j) % VOCAB for j in range(5 + n)], 1)])
        for step in range(3):
            live = kvs[:n]
            out += runner.forward(
                [ForwardItem(kv, [(3 * step + i) % VOCAB] * (1 + (i + step) % 3), 1) for i, kv in enumerate(live)]
            )
    return out


def test_cuda_graphs_survive_pool_growth_and_failed_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graphs captured, dropped when the pool grows, captured again into a fresh pool; a capture
    that fails runs its forward eagerly. Every forward equals the eager path's (float32)."""
    from specmask.gpu_worker.kv_cache import SequenceKV
    from specmask.gpu_worker.model_runner import ModelRunner
    from specmask.gpu_worker.static_forward import MAX_CAPTURE_FAILURES

    model = _tiny_llama(kv_heads=2).to("cuda")  # grouped heads: the eager path folds them
    eager, static = ModelRunner(model), ModelRunner(model, static="on")
    assert static.static is not None and static.static.use_graphs
    want = _grow_and_decode(eager, [SequenceKV() for _ in range(5)])
    got = _grow_and_decode(static, [SequenceKV() for _ in range(5)])
    assert static.static.captures > 5 and static.static.replays > 0 and static.static.capture_failures == 0
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)

    failing = ModelRunner(model, static="on")
    assert failing.static is not None

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("capture refused by the test")

    monkeypatch.setattr(torch.cuda, "graph", refuse)
    got = _grow_and_decode(failing, [SequenceKV() for _ in range(5)])
    assert failing.static.captures == 0 and failing.static.capture_failures == MAX_CAPTURE_FAILURES
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
