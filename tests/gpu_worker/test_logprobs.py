"""Per-token logprobs from the worker equal a plain PyTorch recomputation.

The reference uses no worker code: one HF forward over prompt + output, xgrammar's own
matcher and mask function on every output position, then log_softmax(masked logits / T)
(T = 1 for greedy). Speculative and plain decoding must report the same numbers, drafts
accepted, recovered and bonus tokens alike, and a grammar-forbidden token never appears
among the alternatives.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from specmask.common.grammar_spec import GrammarSpec
from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams, TokenLogprob
from tests.gpu_worker.helpers import run_to_completion
from tests.gpu_worker.reference import _model, compile_grammar
from tests.gpu_worker.test_greedy_equivalence import EOS, GRAMMARS, PROMPTS

TOP = 5
MAX_TOKENS = 40
TOL = 2e-4
SPEC = SpeculationParams(k=4, proposers=("draft_model", "grammar_forced"), draft_masking=True)
PLAIN = SpeculationParams(enabled=False, k=0)


@torch.no_grad()
def reference_logprobs(
    model_dir: Path, prompt: list[int], output: list[int], grammar: tuple[Any, str] | None, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax of the masked target rows / T' [len(output), V], allowed [len(output), V])."""
    import xgrammar as xgr

    model = _model(str(model_dir))
    vocab = model.config.vocab_size
    logits = model(torch.tensor([prompt + output])).logits[0].float()  # [len, V]
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(output)].clone()  # row i predicts output[i]
    allowed = torch.ones_like(rows, dtype=torch.bool)
    if grammar is not None:
        matcher = xgr.GrammarMatcher(compile_grammar(model_dir, grammar[0].value, grammar[1], EOS))
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        for i, token in enumerate(output):
            matcher.fill_next_token_bitmask(bitmask)
            row = rows[i : i + 1].clone()
            xgr.apply_token_bitmask_inplace(row, bitmask)
            rows[i] = row[0]
            assert matcher.accept_token(token), (i, token)
        allowed = torch.isfinite(rows)
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(rows / scale, dim=-1), allowed


def _sequences(tok: Any, spec: SpeculationParams, sampling: SamplingParams) -> list[NewSequence]:
    seqs = []
    for name, grammar in GRAMMARS.items():
        g = None if grammar is None else GrammarSpec(grammar[0], grammar[1])
        seqs.append(NewSequence(name, tuple(tok.encode(PROMPTS[name])), g, sampling, spec))
    return seqs


@pytest.fixture(scope="module")
def tokenizer(tiny_pair: tuple[Path, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_pair[0]))


def _run(make_worker: Any, tokenizer: Any, spec: SpeculationParams, sampling: SamplingParams) -> dict[str, Any]:
    worker = make_worker()
    seqs = _sequences(tokenizer, spec, sampling)
    assert worker.add(seqs) == [None] * len(seqs)
    results = run_to_completion(worker)
    for name, got in results.items():
        assert got.error is None, (name, got.error)
        for out in got.outputs:
            assert out.logprobs is not None and [e.token_id for e in out.logprobs] == out.new_token_ids, name
    return results


def _entries(result: Any) -> list[TokenLogprob]:
    return [e for out in result.outputs for e in (out.logprobs or [])]


def _check_against_reference(tiny_pair: tuple[Path, Path], tokenizer: Any, results: dict[str, Any], temperature: float):
    for name, grammar in GRAMMARS.items():
        got = results[name]
        prompt = list(tokenizer.encode(PROMPTS[name]))
        logp, allowed = reference_logprobs(tiny_pair[0], prompt, got.tokens, grammar, temperature)
        entries = _entries(got)
        assert len(entries) == len(got.tokens) > 0
        for i, (token, entry) in enumerate(zip(got.tokens, entries)):
            assert math.isclose(entry.logprob, float(logp[i, token]), abs_tol=TOL), (name, i, entry, logp[i, token])
            want_n = min(TOP, int(allowed[i].sum()))
            assert len(entry.top) == want_n, (name, i, entry.top, want_n)
            ref_top = logp[i].topk(want_n).values.tolist()
            for (tid, value), ref in zip(entry.top, ref_top):
                assert bool(allowed[i, tid]), f"{name}: forbidden token {tid} among the alternatives at {i}"
                assert math.isfinite(value) and math.isclose(value, float(logp[i, tid]), abs_tol=TOL)
                assert math.isclose(value, ref, abs_tol=TOL)


def test_greedy_logprobs_match_recomputation_spec_on_and_off(make_worker, tiny_pair, tokenizer) -> None:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, logprobs=TOP)
    spec = _run(make_worker, tokenizer, SPEC, sampling)
    plain = _run(make_worker, tokenizer, PLAIN, sampling)
    assert sum(r.drafts_accepted for r in spec.values()) > 0  # drafts were accepted, not only bonus tokens
    _check_against_reference(tiny_pair, tokenizer, spec, 0.0)
    for name in GRAMMARS:
        assert spec[name].tokens == plain[name].tokens, name
        for a, b in zip(_entries(spec[name]), _entries(plain[name]), strict=True):
            assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=TOL)
            assert len(a.top) == len(b.top)
            assert all(math.isclose(x, y, abs_tol=TOL) for (_, x), (_, y) in zip(a.top, b.top))
    # A tight grammar has positions where exactly one token is allowed: one alternative there.
    assert any(len(e.top) == 1 for e in _entries(spec["tight_schema"]))


def test_sampled_logprobs_are_the_tempered_masked_target(make_worker, tiny_pair, tokenizer) -> None:
    """Random sampling with top-p: the emitted token's logprob is log_softmax(masked / T), before
    top-p (recovered tokens from p - q included), at the position the target scored it."""
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, logprobs=TOP)
    results = _run(make_worker, tokenizer, SPEC, sampling)
    assert sum(r.drafts_proposed - r.drafts_accepted for r in results.values()) > 0  # rejections happened
    _check_against_reference(tiny_pair, tokenizer, results, 0.8)


def test_only_requests_that_ask_get_logprobs(make_worker, tokenizer) -> None:
    worker = make_worker()
    seqs = _sequences(tokenizer, SPEC, SamplingParams(max_tokens=12))
    seqs[0] = NewSequence(
        "asks", seqs[0].prompt_token_ids, seqs[0].grammar, SamplingParams(max_tokens=12, logprobs=0), SPEC
    )
    assert worker.add(seqs) == [None] * len(seqs)
    results = run_to_completion(worker)
    for name, got in results.items():
        for out in got.outputs:
            if name == "asks":
                assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
                assert all(e.top == () and e.logprob <= 0.0 for e in out.logprobs)
            else:
                assert out.logprobs is None


def test_logprobs_bound_is_checked(make_worker, tokenizer) -> None:
    worker = make_worker()
    seq = _sequences(tokenizer, SPEC, SamplingParams(max_tokens=4, logprobs=21))[0]
    [error] = worker.add([seq])
    assert error is not None and "logprobs" in error
