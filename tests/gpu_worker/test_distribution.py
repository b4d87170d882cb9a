"""Sampled speculative output has exactly the masked target's distribution.

The exact distribution over complete outputs of a small finite grammar is
enumerated with plain HF forwards and xgrammar (tests/gpu_worker/reference.py);
the worker samples many seeded sequences with a draft model that differs from
the target (so rejections and recovered tokens happen) and a chi-square test
compares. Deterministic: fixed seeds.
"""

from __future__ import annotations

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import run_to_completion, torch_threads
from tests.gpu_worker.reference import compile_grammar, exact_distribution

scipy_stats = pytest.importorskip("scipy.stats")

GRAMMAR = "root ::= [a-d] [a-d] [a-d]?"
# After its first letter this grammar forces the text "status" (several tokens of the tiny
# pair's BPE: st|at|u|s), so drafts come from forced continuations (specmask/mask_service/grammar/forced.py).
FORCED_GRAMMAR = 'root ::= [a-d] "status" [a-d]?'
PROMPT = [5, 6, 7]
TEMPERATURE = 0.25  # sharpens the random-init models so p and q differ clearly
NUM_SAMPLES = 800
BATCH = 200
EOS = 0


@pytest.fixture(scope="module")
def exact(tiny_pair):
    """grammar -> its exact output distribution (computed on first use)."""
    cache: dict[str, dict] = {}

    def get(grammar: str) -> dict:
        if grammar not in cache:
            with torch_threads(1):
                compiled = compile_grammar(tiny_pair[0], "ebnf", grammar, (EOS,))
                cache[grammar] = exact_distribution(tiny_pair[0], PROMPT, compiled, TEMPERATURE)
        return cache[grammar]

    return get


def _chi_square_pvalue(counts: dict, exact: dict, n: int) -> float:
    """Pool outcomes with expected count < 5 into one bin, then chi-square."""
    observed, expected = [], []
    pooled_obs, pooled_exp = 0.0, 0.0
    for outcome, p in exact.items():
        if p * n >= 5:
            observed.append(counts.get(outcome, 0))
            expected.append(p * n)
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += p * n
    observed.append(pooled_obs)
    expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)  # float round-off only: exact sums to 1 within 1e-7
    expected = [e * scale for e in expected]
    return float(scipy_stats.chisquare(observed, expected).pvalue)


SPECS = {
    # Masked drafts (valid by construction) plus grammar-forced ones.
    "grammar_aware": (SpeculationParams(k=3, proposers=("draft_model", "grammar_forced"), draft_masking=True), GRAMMAR),
    # Blind drafts: mostly invalid, rejected by the verify-side masks, recovered from p - q.
    "blind": (SpeculationParams(k=3, proposers=("draft_model",), draft_masking=False), GRAMMAR),
    # Forced continuations (q = 1) mixed with masked draft-model drafts.
    "forced_text": (
        SpeculationParams(k=3, proposers=("draft_model", "grammar_forced"), draft_masking=True),
        FORCED_GRAMMAR,
    ),
}


@pytest.mark.parametrize("mode", list(SPECS))
def test_sampled_speculative_output_matches_exact_distribution(make_worker, exact, mode, monkeypatch):
    import specmask.mask_service.server.draft_masks as draft_masks

    forced_runs = []  # the (in-process) mask service's non-empty forced continuations
    compute = draft_masks.forced_continuation

    def counting(*args, **kwargs):
        out = compute(*args, **kwargs)  # a ForcedRun
        forced_runs.extend([out.tokens] if out.tokens else [])
        return out

    monkeypatch.setattr(draft_masks, "forced_continuation", counting)
    worker = make_worker(max_batch=BATCH)
    spec, grammar = SPECS[mode]
    exact = exact(grammar)
    counts: dict[tuple[int, ...], int] = {}
    accepted = proposed = 0
    for start in range(0, NUM_SAMPLES, BATCH):
        seqs = [
            NewSequence(
                f"s{i}",
                tuple(PROMPT),
                GrammarSpec(GrammarKind.EBNF, grammar),
                SamplingParams(temperature=TEMPERATURE, seed=i if mode == "blind" else 10_000 + i, max_tokens=10),
                spec,
            )
            for i in range(start, start + BATCH)
        ]
        assert worker.add(seqs) == [None] * BATCH
        for r in run_to_completion(worker).values():
            outcome = tuple(r.tokens) + (EOS,)  # complete outputs end with the (unreturned) stop token
            assert outcome in exact, f"impossible output {outcome}"
            counts[outcome] = counts.get(outcome, 0) + 1
            accepted += r.drafts_accepted
            proposed += r.drafts_proposed
    assert 0 < accepted < proposed  # rejections happened, so recovered tokens were exercised
    if mode == "forced_text":
        assert any(len(run) > 1 for run in forced_runs), "no multi-token forced continuation was proposed"
    p_value = _chi_square_pvalue(counts, exact, NUM_SAMPLES)
    assert p_value > 1e-3, (p_value, counts, exact)
