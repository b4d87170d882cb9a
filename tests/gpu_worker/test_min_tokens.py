"""min_tokens and min_p in the worker: EOS is suppressed per output position (so per target row
under speculation, and at the draft's positions too), greedy output equals plain constrained
greedy decoding with the same suppression, and a grammar that allows only EOS before the minimum
fails the sequence instead of emitting anything outside its mask."""

from __future__ import annotations

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import (
    MIN_TOKENS_UNREACHABLE,
    ErrorKind,
    FinishReason,
    NewSequence,
    SamplingParams,
    SpeculationParams,
)
from tests.gpu_worker.helpers import run_to_completion, torch_threads
from tests.gpu_worker.reference import compile_grammar, greedy_constrained

EOS = (0,)  # the tiny pair's <|eos|>
MAX_TOKENS = 40

# name -> (grammar, prompt): cases where the tiny (random) target's greedy output is EOS at once;
# min_tokens pushes the end back. Up to 8 letters, so the grammar itself ends the longer outputs.
CASES: dict[str, tuple[tuple[GrammarKind, str], str]] = {
    "abc": ((GrammarKind.EBNF, "root ::= [a-c]{0,8}"), "answer?"),
    "ab": ((GrammarKind.EBNF, "root ::= [a-b]{0,8}"), "q"),
}
SPECS = {
    "plain": SpeculationParams(enabled=False, k=0, proposers=()),
    "draft+masks+forced": SpeculationParams(k=4, proposers=("draft_model", "grammar_forced"), draft_masking=True),
    "draft_blind": SpeculationParams(k=3, proposers=("draft_model",), draft_masking=False),
    "ngram+forced": SpeculationParams(k=4, proposers=("ngram", "grammar_forced"), draft_masking=False),
}


@pytest.fixture(scope="module")
def plain_refs(tiny_pair):
    """Per case: (prompt ids, compiled grammar, greedy reference without min_tokens)."""
    from transformers import AutoTokenizer

    target_dir = tiny_pair[0]
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    out = {}
    with torch_threads(1):
        for name, (grammar, prompt_text) in CASES.items():
            prompt = tok.encode(prompt_text)
            compiled = compile_grammar(target_dir, grammar[0].value, grammar[1], EOS)
            out[name] = (prompt, compiled, greedy_constrained(target_dir, prompt, compiled, EOS, MAX_TOKENS))
    return out


def _run(make_worker, seqs: list[NewSequence]):
    worker = make_worker()
    assert worker.add(seqs) == [None] * len(seqs)
    return run_to_completion(worker)


@pytest.mark.parametrize("spec", list(SPECS))
def test_greedy_min_tokens_matches_the_suppressed_reference(tiny_pair, make_worker, plain_refs, spec):
    """Each case stops early without min_tokens; with min_tokens past that stop (a few values, so
    the minimum falls at different offsets inside a speculative step) the worker's tokens equal
    plain greedy decoding with EOS removed before the minimum, whatever the proposers."""
    seqs, expected = [], {}
    with torch_threads(1):
        for name, (prompt, compiled, plain) in plain_refs.items():
            assert plain.finish == "stop" and not plain.tokens, (name, plain)  # not vacuous: EOS at once
            grammar = CASES[name][0]
            for extra in (1, 3, 6):
                min_tokens = len(plain.tokens) + extra
                ref = greedy_constrained(tiny_pair[0], prompt, compiled, EOS, MAX_TOKENS, min_tokens=min_tokens)
                seq_id = f"{name}-{extra}"
                expected[seq_id] = (ref, min_tokens)
                seqs.append(
                    NewSequence(
                        seq_id,
                        tuple(prompt),
                        GrammarSpec(grammar[0], grammar[1]),
                        SamplingParams(max_tokens=MAX_TOKENS, min_tokens=min_tokens),
                        SPECS[spec],
                    )
                )
    results = _run(make_worker, seqs)
    for seq_id, (ref, min_tokens) in expected.items():
        got = results[seq_id]
        assert got.error is None, (seq_id, got.error)
        assert got.tokens == ref.tokens, (seq_id, got.tokens, ref.tokens)
        assert len(got.tokens) >= min_tokens and EOS[0] not in got.tokens[:min_tokens]
        assert ref.finish == "stop" and got.finish is FinishReason.GRAMMAR_COMPLETE, (seq_id, ref.finish, got.finish)
    if spec != "plain":
        assert sum(r.drafts_proposed for r in results.values()) > 0  # speculation really ran


@pytest.mark.parametrize("spec", ["plain", "draft+masks+forced", "ngram+forced"])
def test_grammar_that_allows_only_eos_before_min_tokens_fails_the_sequence(tiny_pair, make_worker, spec):
    """``cd`` then EOS is the grammar's only sentence: min_tokens 6 cannot be met. The sequence
    ends with ERROR naming min_tokens, its tokens so far are the grammar's, and no EOS (or any
    other token outside the mask) was emitted; the other sequence in the batch is unaffected."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    prompt = tuple(tok.encode("code:"))
    regex = GrammarSpec(GrammarKind.REGEX, "cd")
    seqs = [
        NewSequence("short", prompt, regex, SamplingParams(max_tokens=20, min_tokens=6), SPECS[spec]),
        NewSequence("fine", prompt, regex, SamplingParams(max_tokens=20, min_tokens=1), SPECS[spec]),
        NewSequence(
            "sampled", prompt, regex, SamplingParams(temperature=1.0, seed=3, max_tokens=20, min_tokens=6), SPECS[spec]
        ),
    ]
    results = _run(make_worker, seqs)
    for seq_id in ("short", "sampled"):
        got = results[seq_id]
        assert got.finish is FinishReason.ERROR, (seq_id, got.finish, got.tokens)
        assert got.error is not None and got.error.startswith(MIN_TOKENS_UNREACHABLE), got.error
        assert "min_tokens=6" in got.error
        # Typed, so the APIs report the caller's own conflict (HTTP 400) without reading the words.
        assert got.outputs[-1].error_kind is ErrorKind.MIN_TOKENS_UNREACHABLE, got.outputs[-1]
        assert tok.decode(got.tokens) in ("", "c", "cd") and EOS[0] not in got.tokens
    assert results["fine"].finish is FinishReason.GRAMMAR_COMPLETE and tok.decode(results["fine"].tokens) == "cd"


def test_sampled_min_tokens_never_stops_early(make_worker, plain_refs):
    """Random sampling (min_p on too) with and without speculation: no stop before min_tokens."""
    prompt = plain_refs["abc"][0]
    seqs = [
        NewSequence(
            f"s{seed}-{spec}",
            tuple(prompt),
            GrammarSpec(GrammarKind.EBNF, "root ::= [a-z]*"),
            SamplingParams(temperature=1.5, min_p=0.05, seed=seed, max_tokens=MAX_TOKENS, min_tokens=12),
            SPECS[spec],
        )
        for seed in range(4)
        for spec in ("plain", "draft+masks+forced")
    ]
    results = _run(make_worker, seqs)
    for seq_id, got in results.items():
        assert got.error is None, (seq_id, got.error)
        assert len(got.tokens) >= 12 and EOS[0] not in got.tokens[:12], (seq_id, got.tokens)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_suppression_is_per_target_row(backend, monkeypatch):
    """Rows of one speculative step are consecutive output positions: with 2 positions left before
    min_tokens, only the first 2 of the 5 rows lose EOS. EOS is every row's argmax, the drafts are
    each row's best non-EOS token: greedy accepts d_1, d_2 (EOS suppressed there), rejects d_3
    and emits EOS from row 2. The Triton path (TRITON_INTERPRET=1 on CPU) decides the same."""
    import torch

    from specmask.gpu_worker.verifier import VerifyInput, verify
    from specmask.kernels.backend import Backend

    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    vocab = 37  # odd width
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen)
    logits[:, 0] = logits.amax(dim=1) + 1.0  # EOS (id 0) first everywhere
    second = logits[:, 1:].argmax(dim=1) + 1  # [5] the best other token
    drafts = second[:4].tolist()
    for suppressed, expected in ((2, drafts[:2] + [0]), (0, [0]), (5, drafts + [int(second[4])])):
        (result,) = verify(
            [
                VerifyInput(
                    drafts=drafts,
                    q_rows=[None] * 4,
                    logits=logits.clone(),
                    mask=None,
                    temperature=0.0,
                    top_k=0,
                    top_p=1.0,
                    seed=1,
                    step=0,
                    stop_suppressed=suppressed,
                    stop_token_ids=(0, vocab + 5),  # an id past the vocabulary is skipped
                )
            ],
            vocab_size=vocab,
            num_mask_words=(vocab + 31) // 32,
            kernel_backend=Backend.TRITON if backend == "triton" else Backend.REFERENCE,
        )
        assert result.error is None and result.emitted == expected, (suppressed, result, expected)
