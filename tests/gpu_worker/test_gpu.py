"""On CUDA: the worker (models, Triton kernels) reproduces plain constrained greedy decoding."""

from __future__ import annotations

import json

import pytest
import torch

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import run_to_completion, torch_threads
from tests.gpu_worker.reference import compile_grammar, greedy_constrained

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
