"""Greedy speculative decoding == plain constrained greedy decoding, token for token.

The reference (tests/gpu_worker/reference.py) uses no worker code: full HF
forwards, xgrammar's matcher and mask function, argmax. Every case runs all
grammars as one mixed batch, so batching, per-sequence k_r and masks of other
sequences are exercised at the same time.
"""

from __future__ import annotations

import json

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import run_to_completion, torch_threads
from tests.gpu_worker.reference import compile_grammar, greedy_constrained

EOS = (0,)  # the tiny pair's <|eos|>
MAX_TOKENS = 48

GRAMMARS: dict[str, tuple[GrammarKind, str] | None] = {
    "tight_schema": (
        GrammarKind.JSON_SCHEMA,
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "status": {"type": "string", "enum": ["active", "inactive", "pending"]},
                    "ok": {"type": "boolean"},
                    "level": {"type": "integer", "minimum": 0, "maximum": 9},
                    "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 3},
                },
                "required": ["status", "ok", "level", "tags"],
                "additionalProperties": False,
            }
        ),
    ),
    "loose_schema": (
        GrammarKind.JSON_SCHEMA,
        json.dumps(
            {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            }
        ),
    ),
    "regex": (GrammarKind.REGEX, r"(ab|cd){1,3}-[0-9]{2,4}(x|yz)"),
    "ebnf": (GrammarKind.EBNF, 'root ::= "yes" | "no" | ("maybe:" [0-9]+ ";")'),
    "none": None,
}
PROMPTS = {
    "tight_schema": "Generate JSON for schema status:\n",
    "loose_schema": "Generate JSON for schema user:\n",
    "regex": "code:",
    "ebnf": "answer?",
    "none": '{"a":',
}


@pytest.fixture(scope="module")
def references(tiny_pair):
    from transformers import AutoTokenizer

    target_dir = tiny_pair[0]
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    refs = {}
    with torch_threads(1):
        for name, grammar in GRAMMARS.items():
            prompt = tok.encode(PROMPTS[name])
            compiled = None if grammar is None else compile_grammar(target_dir, grammar[0].value, grammar[1], EOS)
            refs[name] = (prompt, greedy_constrained(target_dir, prompt, compiled, EOS, MAX_TOKENS))
    return refs


MODES = {
    "draft+masks+forced": SpeculationParams(proposers=("draft_model", "grammar_forced"), draft_masking=True),
    "draft_blind": SpeculationParams(proposers=("draft_model",), draft_masking=False),
    "draft+forced_no_masks": SpeculationParams(proposers=("draft_model", "grammar_forced"), draft_masking=False),
    "ngram+forced": SpeculationParams(proposers=("ngram", "grammar_forced"), draft_masking=False),
}


def _run(make_worker, references, spec: SpeculationParams, **worker_overrides):
    worker = make_worker(**worker_overrides)
    seqs = []
    for name, grammar in GRAMMARS.items():
        prompt, _ = references[name]
        g = None if grammar is None else GrammarSpec(grammar[0], grammar[1])
        seqs.append(NewSequence(name, tuple(prompt), g, SamplingParams(max_tokens=MAX_TOKENS), spec))
    assert worker.add(seqs) == [None] * len(seqs)
    return run_to_completion(worker)


def _check(results, references):
    for name in GRAMMARS:
        _, ref = references[name]
        got = results[name]
        assert got.error is None, got.error
        assert got.tokens == ref.tokens, (
            f"{name}: worker {got.tokens} != reference {ref.tokens} (min top-2 gap {ref.min_gap:.2e})"
        )
        expected = {"length": FinishReason.LENGTH}.get(ref.finish)
        if expected is None:  # a stop token: grammar sequences end GRAMMAR_COMPLETE, others STOP
            expected = FinishReason.STOP if GRAMMARS[name] is None else FinishReason.GRAMMAR_COMPLETE
        assert got.finish is expected, (name, got.finish, ref.finish)


@pytest.mark.parametrize("k", [0, 1, 4])
def test_greedy_matches_plain_constrained_decoding(make_worker, references, k):
    spec = SpeculationParams(k=k, proposers=("draft_model", "grammar_forced"), draft_masking=True)
    _check(_run(make_worker, references, spec), references)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "draft+masks+forced"])
def test_greedy_matches_for_every_proposer_mix(make_worker, references, mode):
    spec = MODES[mode]
    spec = SpeculationParams(k=4, proposers=spec.proposers, draft_masking=spec.draft_masking)
    _check(_run(make_worker, references, spec), references)


def test_greedy_matches_with_per_sequence_forwards(make_worker, references):
    """The unbatched runner path gives the same tokens (and is what the batched one is tested against)."""
    spec = SpeculationParams(k=4)
    _check(_run(make_worker, references, spec, batched_forward=False), references)


def test_references_are_nontrivial(references):
    """Guard against a vacuous comparison: outputs exist, some stop, none tie."""
    assert all(len(ref.tokens) > 0 for _, ref in references.values())
    assert any(ref.finish == "stop" for _, ref in references.values())
    assert min(ref.min_gap for _, ref in references.values()) > 1e-5


def test_greedy_matches_with_prompts_prefilled_in_chunks(make_worker, references, monkeypatch):
    """Prompts longer than the prefill chunk are cached chunk by chunk (planning.PREFILL_CHUNK_TOKENS, the
    most one prefill forward takes):
    with 2-token chunks every prompt here spans several forwards, and the tokens stay the reference's."""
    from specmask.gpu_worker import planning

    assert max(len(p) for p, _ in references.values()) > 2 * 2
    monkeypatch.setattr(planning, "PREFILL_CHUNK_TOKENS", 2)
    _check(_run(make_worker, references, SpeculationParams(k=4), step_prefill_tokens=1), references)


def test_greedy_matches_with_prompts_prefilled_across_budgeted_iterations(make_worker, references):
    """With an iteration budget of a few tokens, every prompt is cached chunk by chunk over
    several iterations, beside the other sequences' decode steps, and their drafts are trimmed
    to the budget: the tokens stay the unchunked reference's."""
    budget = len(GRAMMARS)  # the least that holds every sequence's row
    assert max(len(p) for p, _ in references.values()) > 2 * budget
    _check(
        _run(
            make_worker,
            references,
            SpeculationParams(k=4),
            max_iteration_tokens=budget,
            max_batch=len(GRAMMARS),
            step_prefill_tokens=2,
        ),
        references,
    )


@pytest.mark.parametrize("step_prefill_tokens", [1, 2])
def test_greedy_matches_with_prompts_prefilled_in_add(make_worker, references, step_prefill_tokens):
    """By default these short prompts are fed whole by each sequence's first step (mixed with the
    others' drafts); with ``step_prefill_tokens`` 1 or 2, prefill chunks cache all but the last
    1 or 2 prompt tokens first. Either way the tokens are the reference's."""
    assert min(len(p) for p, _ in references.values()) > 2
    _check(_run(make_worker, references, SpeculationParams(k=4), step_prefill_tokens=step_prefill_tokens), references)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_matches_on_the_bucketed_static_path(make_worker, references, k: int) -> None:
    """The whole worker (draft forwards, verify forwards, grammar masks) on the static path,
    bucketed as a graph would run it, emits the greedy reference's tokens."""
    spec = SpeculationParams(k=k, proposers=("draft_model", "grammar_forced"), draft_masking=True)
    worker = None

    def make(**overrides: object):  # type: ignore[no-untyped-def]
        nonlocal worker
        worker = make_worker(static_forward="on", **overrides)
        for runner in (worker.target, worker.draft):
            assert runner.static is not None
            runner.static.pad_to_buckets = True
        return worker

    for _ in range(10):
        results = _run(make, references, spec)
        # A busy box can refuse a cold grammar while it compiles: run again once it is cached.
        if not any("still compiling" in (r.error or "") for r in results.values()):
            break
    _check(results, references)
    assert worker is not None and worker.target.static.forwards > 0 and worker.draft.static.forwards > 0
