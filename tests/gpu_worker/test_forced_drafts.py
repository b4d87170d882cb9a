"""Forced-continuation drafts (gpu_worker/drafting.py + mask_service/grammar/forced.py) on the tiny pair.

The grammars force multi-token text (JSON keys, a regex literal) that no single
row pins to one token, so these drafts come only from the forced continuations
the draft-side mask replies carry. Checked: they are proposed, every emitted
token is accepted by an independent xgrammar matcher (greedy and sampled), and
greedy output is the same with and without them.
"""

from __future__ import annotations

import json

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import run_to_completion
from tests.gpu_worker.reference import compile_grammar

EOS = 0
GRAMMARS = {
    "keys": (
        GrammarKind.JSON_SCHEMA,
        json.dumps(
            {
                "type": "object",
                "properties": {
                    "status": {"type": "string", "enum": ["active", "pending"]},
                    "total_amount": {"type": "integer"},
                    "description": {"type": "string", "maxLength": 6},
                },
                "required": ["status", "total_amount", "description"],
                "additionalProperties": False,
            }
        ),
    ),
    "regex": (GrammarKind.REGEX, r"(ab|cd)-status-[0-9]{2}"),
}
SPEC = SpeculationParams(k=4, proposers=("grammar_forced",), draft_masking=False)


def _run(make_worker, monkeypatch, *, forced: bool, temperature: float = 0.0):
    """Run every grammar (greedy, or sampled with seeds); returns (results, forced runs proposed)."""
    import specmask.mask_service.server.draft_masks as draft_masks
    from specmask.mask_service.grammar.forced import ForcedRun

    runs: list[list[int]] = []
    compute = draft_masks.forced_continuation

    def recording(*args, **kwargs):
        out = compute(*args, **kwargs) if forced else ForcedRun([], 0)
        runs.extend([out.tokens] if out.tokens else [])
        return out

    monkeypatch.setattr(draft_masks, "forced_continuation", recording)
    worker = make_worker()
    seqs = [
        NewSequence(
            f"{name}-{i}",
            (5, 6, 7 + i),
            GrammarSpec(kind, text),
            SamplingParams(temperature=temperature, seed=i, max_tokens=60),
            SPEC,
        )
        for name, (kind, text) in GRAMMARS.items()
        for i in range(3 if temperature else 1)
    ]
    assert worker.add(seqs) == [None] * len(seqs)
    return run_to_completion(worker), runs


def _check_in_grammar(tiny_pair, results) -> None:
    import xgrammar as xgr

    for seq_id, r in results.items():
        assert r.error is None, (seq_id, r.error)
        kind, text = GRAMMARS[seq_id.rsplit("-", 1)[0]]
        matcher = xgr.GrammarMatcher(compile_grammar(tiny_pair[0], kind.value, text, (EOS,)))
        for i, token in enumerate(r.tokens):
            assert matcher.accept_token(token), f"{seq_id}: token {token} at {i} is outside the grammar"
        if r.finish is FinishReason.GRAMMAR_COMPLETE:
            assert matcher.accept_token(EOS), f"{seq_id}: ended before the document was complete"


def test_forced_drafts_are_proposed_and_stay_in_grammar(tiny_pair, make_worker, monkeypatch) -> None:
    with_forced, runs = _run(make_worker, monkeypatch, forced=True)
    assert any(len(run) > 1 for run in runs), "no multi-token forced continuation was proposed"
    _check_in_grammar(tiny_pair, with_forced)
    without, none = _run(make_worker, monkeypatch, forced=False)
    assert not none
    for seq_id, r in with_forced.items():
        assert r.tokens == without[seq_id].tokens, seq_id  # greedy: drafts never change the output
    assert sum(r.drafts_proposed for r in with_forced.values()) > sum(r.drafts_proposed for r in without.values())
    assert sum(r.steps for r in with_forced.values()) < sum(r.steps for r in without.values())


@pytest.mark.parametrize("temperature", [1.0])
def test_sampled_forced_drafts_stay_in_grammar(tiny_pair, make_worker, monkeypatch, temperature) -> None:
    results, runs = _run(make_worker, monkeypatch, forced=True, temperature=temperature)
    assert runs
    _check_in_grammar(tiny_pair, results)


LOOKAHEAD_SPEC = SpeculationParams(k=4, proposers=("grammar_forced", "ngram"), draft_masking=False)


def _run_counting_calls(make_worker, grammars):
    """Run ``grammars`` (name -> (kind, text)) greedily with grammar-forced + n-gram drafts on a
    fresh worker; returns (results, DraftMasks calls the worker made)."""
    worker = make_worker()
    # Every step drafts as planned: the speculation gate chooses by wall clock, so on a busy
    # box it could decode plainly in one run and not the other, and the counts would differ.
    worker.stepper.gate.enabled = False
    calls = [0]
    inner = worker.masks.draft_masks_async

    def counted(items):
        calls[0] += 1
        return inner(items)

    worker.masks.draft_masks_async = counted
    seqs = [
        NewSequence(name, (5, 6, 7), GrammarSpec(kind, text), SamplingParams(max_tokens=40), LOOKAHEAD_SPEC)
        for name, (kind, text) in grammars.items()
    ]
    # Waiting for the sessions gives every run the same schedule, so call counts compare exactly.
    assert worker.add(seqs, wait_for_sessions=True) == [None] * len(seqs)
    return run_to_completion(worker), calls[0]


def test_ngram_lookahead_cuts_round_trips_and_keeps_output(tiny_pair, make_worker, monkeypatch) -> None:
    """Grammar-forced + n-gram drafting sends its n-gram lookahead with each draft-side request
    (drafting.py "Lookahead"): fewer mask round trips per step than asking position by
    position, the same greedy output, every token inside the grammar."""
    import specmask.gpu_worker.drafting as drafting

    grammars = {"keys": GRAMMARS["keys"], "ab": (GrammarKind.REGEX, r"[ab]{24}")}
    with_lookahead, calls_on = _run_counting_calls(make_worker, grammars)
    monkeypatch.setattr(drafting, "LOOKAHEAD_PROPOSERS", frozenset())  # position by position
    position_by_position, calls_off = _run_counting_calls(make_worker, grammars)
    assert {k: r.tokens for k, r in with_lookahead.items()} == {k: r.tokens for k, r in position_by_position.items()}
    monkeypatch.setitem(GRAMMARS, "ab", grammars["ab"])  # _check_in_grammar looks grammars up by name
    _check_in_grammar(tiny_pair, {f"{k}-0": r for k, r in with_lookahead.items()})
    assert calls_on < calls_off, (calls_on, calls_off)


# Grammars whose forced runs meet the n-gram lookahead: JSON keys, a regex literal, repeated groups.
RUN_GRAMMARS = {"keys": GRAMMARS["keys"], "regex": GRAMMARS["regex"], "ab": (GrammarKind.REGEX, r"([ab]{3}-){6}")}


def _fewer_round_trips_than(tiny_pair, make_worker, monkeypatch, without) -> None:
    """Run RUN_GRAMMARS as the worker drafts, then again after ``without(monkeypatch)`` takes a
    saving away: the same greedy output, every token inside the grammar, and fewer DraftMasks
    calls with the saving."""
    saved, calls_saved = _run_counting_calls(make_worker, RUN_GRAMMARS)
    without(monkeypatch)
    plain, calls_plain = _run_counting_calls(make_worker, RUN_GRAMMARS)
    assert {k: r.tokens for k, r in saved.items()} == {k: r.tokens for k, r in plain.items()}
    monkeypatch.setitem(GRAMMARS, "ab", RUN_GRAMMARS["ab"])  # _check_in_grammar looks grammars up by name
    _check_in_grammar(tiny_pair, {f"{k}-0": r for k, r in saved.items()})
    assert calls_saved < calls_plain, (calls_saved, calls_plain)


def test_a_row_forcing_one_token_where_the_lookahead_stops_takes_the_whole_run(
    tiny_pair, make_worker, monkeypatch
) -> None:
    """Where the service's walk stopped on a refused n-gram token at a row that forces one token,
    the slot takes the reply's forced run from there (that token and what follows it, e.g. a
    key's closing quote, colon and the next key) rather than the one token and a re-ask: fewer
    round trips for the same steps and greedy output, every token inside the grammar."""
    import specmask.gpu_worker.drafting as drafting

    walk = drafting.Drafter._walk

    def one_token_only(self, *args, run_at_stop: bool):
        return walk(self, *args, run_at_stop=False)  # the forced token alone, then a re-ask

    _fewer_round_trips_than(
        tiny_pair, make_worker, monkeypatch, lambda mp: mp.setattr(drafting.Drafter, "_walk", one_token_only)
    )


def _run_each_twice(make_worker, grammars, spec: SpeculationParams):
    """Two greedy sequences per grammar (name -> (kind, text)), prompts differing in their last
    token, on a fresh worker; returns (worker, results). Sessions open before the first step, so
    runs repeat their schedule exactly."""
    worker = make_worker()
    seqs = [
        NewSequence(f"{name}-{i}", (5, 6, 7 + i), GrammarSpec(kind, text), SamplingParams(max_tokens=60), spec)
        for name, (kind, text) in grammars.items()
        for i in range(2)
    ]
    assert worker.add(seqs, wait_for_sessions=True) == [None] * len(seqs)
    return worker, run_to_completion(worker)


@pytest.mark.parametrize(
    "proposers",
    [("grammar_forced", "ngram", "draft_model"), ("grammar_forced", "draft_model")],
    ids=["forced+ngram+draft", "forced+draft"],
)
def test_a_step_never_proposes_more_than_k(tiny_pair, make_worker, proposers) -> None:
    """A forced run that fills a slot to k at position 1 (from the prefetched reply) closed the
    slot for the cheap proposers only after they had run: an n-gram or draft token went in as
    draft k + 1, unmasked. Every step's drafts must stay within the sequence's k."""
    spec = SpeculationParams(k=2, proposers=proposers, draft_masking=True)
    _, results = _run_each_twice(make_worker, GRAMMARS, spec)
    _check_in_grammar(tiny_pair, results)
    steps = [out for r in results.values() for out in r.outputs]
    assert any(out.drafts_proposed == spec.k for out in steps)  # forced runs did fill slots
    assert max(out.drafts_proposed for out in steps) <= spec.k


def test_the_draft_forward_is_skipped_where_the_ngram_lookup_fills_the_position(
    tiny_pair, make_worker, monkeypatch
) -> None:
    """With the draft model behind the n-gram proposer, a slot whose n-gram lookup has a token
    for the position gets no draft forward (``Proposer.foresees``): the n-gram proposal wins
    there anyway. Fewer draft forwards, the same greedy output, every token inside
    the grammar; a lookup the row then refuses falls back to a late draft forward."""
    from specmask.gpu_worker.proposers.ngram import NgramProposer

    spec = SpeculationParams(k=4, proposers=("grammar_forced", "ngram", "draft_model"), draft_masking=True)
    grammars = {"keys": GRAMMARS["keys"], "ab": (GrammarKind.REGEX, r"([ab]{3}-){6}")}

    def run() -> tuple[dict, int]:
        worker, results = _run_each_twice(make_worker, grammars, spec)
        return results, worker.draft.num_forwards

    foreseen, forwards_foreseen = run()
    monkeypatch.setattr(NgramProposer, "foresees", lambda self, slot: False)
    blind, forwards_blind = run()
    assert {k: r.tokens for k, r in foreseen.items()} == {k: r.tokens for k, r in blind.items()}
    monkeypatch.setitem(GRAMMARS, "ab", grammars["ab"])
    _check_in_grammar(tiny_pair, foreseen)
    assert forwards_foreseen < forwards_blind, (forwards_foreseen, forwards_blind)
