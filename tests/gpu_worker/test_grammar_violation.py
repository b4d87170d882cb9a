"""Never lie through a real worker: a target model that produces NaN logits (a broken
checkpoint) makes the sampler pick a token the grammar forbids; the rejection
sampler's mask check fails that sequence with GRAMMAR_VIOLATION and commits nothing,
and the other sequences of the batch carry on."""

from __future__ import annotations

import math

import torch

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import run_to_completion


def test_nan_model_output_is_caught_on_device_not_emitted(make_worker) -> None:
    worker = make_worker()
    with torch.no_grad():
        worker.target.model.get_output_embeddings().weight.fill_(math.nan)  # every logit NaN
    grammar = GrammarSpec(GrammarKind.REGEX, "(yes|no)")  # EOS (id 0) is not allowed first
    seqs = [
        NewSequence("random", (5, 6), grammar, SamplingParams(temperature=1.0, seed=1, max_tokens=8)),
        NewSequence(
            "random-spec",
            (5, 6),
            grammar,
            SamplingParams(temperature=0.5, seed=2, max_tokens=8),
            SpeculationParams(k=2, proposers=("grammar_forced", "ngram")),
        ),
        NewSequence("plain", (5, 6), None, SamplingParams(temperature=1.0, seed=3, max_tokens=4)),
    ]
    assert worker.add(seqs) == [None, None, None]
    results = run_to_completion(worker)
    for seq_id in ("random", "random-spec"):
        r = results[seq_id]
        assert r.finish is FinishReason.GRAMMAR_VIOLATION, (seq_id, r.finish, r.tokens)
        assert r.tokens == [] and "outside the grammar mask" in (r.error or "")
    # No grammar: the all-ones row allows the fallback token, so nothing is flagged.
    assert results["plain"].finish in (FinishReason.STOP, FinishReason.LENGTH)
    assert worker.num_active() == 0
