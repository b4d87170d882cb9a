"""GpuWorker in-process: length limits, joins/finishes, forced drafts, sampling, cleanup."""

from __future__ import annotations

import json
import uuid

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.speculation_gate import Arm
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import run_to_completion, torch_threads, wait_sessions_closed, wait_sessions_open
from tests.gpu_worker.reference import compile_grammar, greedy_constrained

EOS = (0,)
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "kind": {"type": "string", "enum": ["alpha", "beta"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        },
        "required": ["kind", "count", "flags"],
        "additionalProperties": False,
    }
)
GRAMMAR = GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA)


def _valid_prefix(tiny_pair, tokens: list[int], *, complete: bool) -> bool:
    """Replay tokens through an independent xgrammar matcher."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compile_grammar(tiny_pair[0], "json_schema", SCHEMA, EOS))
    if not all(matcher.accept_token(t) for t in tokens):
        return False
    return matcher.accept_token(EOS[0]) if complete else True


def _reference(tiny_pair, prompt, max_tokens, max_len=None, grammar=True):
    compiled = compile_grammar(tiny_pair[0], "json_schema", SCHEMA, EOS) if grammar else None
    with torch_threads(1):
        return greedy_constrained(tiny_pair[0], prompt, compiled, EOS, max_tokens, max_len)


def test_k_is_zero_near_max_length_and_output_stays_exact(make_worker, tiny_pair):
    """k_r = 0 once x + K would pass the model length; other sequences keep speculating."""
    max_len, k = 30, 4
    worker = make_worker(max_model_len=max_len)
    prompts = {"short": [7, 8, 9], "long": list(range(3, 22))}
    spec = SpeculationParams(k=k)
    assert worker.add(
        [NewSequence(n, tuple(p), GRAMMAR, SamplingParams(max_tokens=100), spec) for n, p in prompts.items()]
    ) == [None, None]
    lengths = {n: len(p) for n, p in prompts.items()}
    mixed_step_seen = False
    results = run_to_completion(worker)
    for name in prompts:
        for out in results[name].outputs:
            if lengths[name] + k > max_len:
                assert out.drafts_proposed == 0, (name, lengths[name])
            lengths[name] += len(out.new_token_ids)
    steps = zip(results["short"].outputs, results["long"].outputs)
    mixed_step_seen = any(a.drafts_proposed > 0 and b.drafts_proposed == 0 for a, b in steps)
    assert mixed_step_seen, "expected a step where one sequence speculates and the other decodes plainly"
    for name, prompt in prompts.items():
        ref = _reference(tiny_pair, prompt, 100, max_len)
        assert results[name].tokens == ref.tokens
        if ref.finish == "length":
            assert results[name].finish is FinishReason.LENGTH
            assert len(prompt) + len(results[name].tokens) == max_len


def test_sequences_join_and_finish_at_different_steps(make_worker, tiny_pair):
    worker = make_worker()
    spec = SpeculationParams(k=3)
    tokens: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}

    def step() -> None:
        for out in worker.step():
            tokens.setdefault(out.seq_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finish[out.seq_id] = out.finish_reason

    prompts = {"a": [5, 6, 7, 8], "b": [9, 10], "c": [11, 12, 13]}
    assert worker.add([NewSequence("a", tuple(prompts["a"]), GRAMMAR, SamplingParams(max_tokens=30), spec)]) == [None]
    step()
    step()
    assert worker.add(
        [
            NewSequence("b", tuple(prompts["b"]), None, SamplingParams(max_tokens=7), spec),
            NewSequence("c", tuple(prompts["c"]), GRAMMAR, SamplingParams(max_tokens=50), SpeculationParams(k=0)),
        ]
    ) == [None, None]
    wait_sessions_open(worker)
    step()
    worker.remove(["c"])  # cancelled mid-flight
    assert worker.num_active() == 2
    while worker.num_active():
        step()
    assert "c" not in finish and len(tokens["c"]) >= 1
    assert tokens["a"] == _reference(tiny_pair, prompts["a"], 30).tokens
    assert tokens["b"] == _reference(tiny_pair, prompts["b"], 7, grammar=False).tokens
    assert tokens["c"] == _reference(tiny_pair, prompts["c"], 50).tokens[: len(tokens["c"])]
    assert finish["b"] is FinishReason.LENGTH and len(tokens["b"]) == 7
    assert finish["a"] in (FinishReason.GRAMMAR_COMPLETE, FinishReason.LENGTH)


def test_grammar_forced_drafts_are_always_accepted_and_valid(make_worker, tiny_pair, monkeypatch):
    """With only single-allowed-token drafts, every draft has masked target probability 1.
    Forced continuations (multi-token forced text, test_forced_drafts.py) are off here: the
    target may spell forced text with other tokens, so those drafts can be rejected."""
    import specmask.mask_service.server.draft_masks as draft_masks
    from specmask.mask_service.grammar.forced import ForcedRun

    monkeypatch.setattr(draft_masks, "forced_continuation", lambda *args, **kwargs: ForcedRun([], 0))
    worker = make_worker()
    seqs = [
        NewSequence(
            f"s{i}",
            (5 + i, 6),
            GRAMMAR,
            SamplingParams(max_tokens=60, temperature=temp, seed=i),
            SpeculationParams(k=6, proposers=("grammar_forced",)),
        )
        for i, temp in enumerate([0.0, 0.0, 1.0, 1.0, 0.7])
    ]
    assert worker.add(seqs) == [None] * len(seqs)
    results = run_to_completion(worker)
    total_forced = 0
    for name, r in results.items():
        for out in r.outputs:
            assert out.drafts_accepted == out.drafts_proposed, (name, out)
            total_forced += out.drafts_proposed
        assert _valid_prefix(tiny_pair, r.tokens, complete=r.finish is FinishReason.GRAMMAR_COMPLETE), name
    assert total_forced > 20  # the schema's keys and punctuation are mostly forced


@pytest.mark.parametrize("draft_masking", [True, False])
def test_sampled_outputs_are_grammar_valid_and_seeded_reproducible(make_worker, tiny_pair, draft_masking):
    spec = SpeculationParams(k=4, proposers=("draft_model", "grammar_forced", "ngram"), draft_masking=draft_masking)
    seqs = [
        NewSequence(
            f"r{i}", (5, 6, 7), GRAMMAR, SamplingParams(max_tokens=50, temperature=1.0, top_p=0.95, seed=i), spec
        )
        for i in range(6)
    ]
    runs = []
    for _ in range(2):
        worker = make_worker()
        # Sessions open while steps run (add() does not wait), so which sequences the first
        # steps hold depends on timing, and the batch shapes each sequence's drafts (verify
        # width, learned from earlier steps): a seeded sequence replays exactly under the same
        # schedule, which waiting for the opens here gives both runs.
        assert worker.add(seqs, wait_for_sessions=True) == [None] * len(seqs)
        runs.append(run_to_completion(worker))
    for name in runs[0]:
        assert runs[0][name].tokens == runs[1][name].tokens, name
        r = runs[0][name]
        assert _valid_prefix(tiny_pair, r.tokens, complete=r.finish is FinishReason.GRAMMAR_COMPLETE), name
    assert len({tuple(r.tokens) for r in runs[0].values()}) > 1  # different seeds, different outputs


def test_mask_sessions_are_closed_on_finish_and_cancel(make_worker, mask_service):
    # The service is shared by the whole file and closes are asynchronous, so count only this
    # test's sessions (by request id), never the store's total.
    ids = [f"close-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]

    worker = make_worker()
    seqs = [
        NewSequence(rid, (5, 6), GRAMMAR, SamplingParams(max_tokens=3 + i), SpeculationParams(k=2))
        for i, rid in enumerate(ids)
    ]
    assert worker.add(seqs, wait_for_sessions=True) == [None] * 3
    assert mask_service.sessions.count_for(ids) == 3  # nothing has stepped, so nothing has finished
    worker.step()
    worker.remove([ids[2]])
    run_to_completion(worker)
    assert wait_sessions_closed(mask_service, ids) == 0


def test_step_output_statistics(make_worker):
    worker = make_worker()
    assert worker.step() == []
    assert worker.add([NewSequence("x", (5, 6), GRAMMAR, SamplingParams(max_tokens=20), SpeculationParams(k=3))]) == [
        None
    ]
    out = worker.step()[0]
    assert out.target_forwards == 1
    assert 0 <= out.drafts_accepted <= out.drafts_proposed <= 3
    assert 1 <= len(out.new_token_ids) <= out.drafts_accepted + 1
    assert out.mask_time_s > 0
    info = worker.info()
    assert info.vocab_size == 300 and info.eos_token_ids == EOS and info.has_draft_model


def test_mask_traffic_per_step(make_worker):
    """Per step: the position-1 draft mask was sent right after the previous commit (and
    carries it), one request per further draft position, then one verify request that
    asks only for M_k (the draft-side requests returned M_0..M_{k-1}); a sequence
    without a grammar adds nothing."""
    worker = make_worker()
    requests: list[list] = []
    send = worker.masks.draft_masks_async

    def spy(items):
        requests.append(list(items))
        return send(items)

    worker.masks.draft_masks_async = spy
    spec = SpeculationParams(k=3, proposers=("draft_model",), draft_masking=True)
    seqs = [
        NewSequence("g", (5, 6), GRAMMAR, SamplingParams(max_tokens=40), spec),
        NewSequence("n", (5, 6), None, SamplingParams(max_tokens=40), spec),
    ]
    assert worker.add(seqs) == [None, None]
    state = worker._seqs["g"]
    session = state.session_id or state.session_opening.result(timeout=20).session_id  # add() does not wait
    prefetched = False  # whether the previous step ended by sending this step's M_0
    steps = 0
    while "g" in worker._seqs:
        requests.clear()
        out = {o.seq_id: o for o in worker.step()}["g"]
        steps += 1
        assert all(len(r) == 1 and r[0].session_id == session for r in requests)
        # The next step's M_0 goes out when the next step will draft with draft-side masks
        # (speculation_gate.py).
        stepper = worker.stepper
        masked_next = stepper.gate.choose(stepper.batch_kind(list(worker._seqs.values()))) is Arm.SPECULATE
        prefetch = out.finish_reason is None and stepper.plan_k(worker._seqs["g"]) > 0 and masked_next
        # A step the gate ran without draft-side masks sends none, and its verify request asks
        # for all of M_0..M_k.
        unmasked = stepper.last_arm is Arm.SPECULATE_UNMASKED
        positions = [] if unmasked else list(range(1 if prefetched else 0, out.drafts_proposed))
        expected = (
            [(p, True) for p in positions] + [(out.drafts_proposed, not unmasked)] + ([(0, True)] if prefetch else [])
        )
        assert [(len(r[0].draft_tokens), r[0].last_row_only) for r in requests] == expected
        if prefetch:
            assert list(requests[-1][0].commit_tokens) == out.new_token_ids
        prefetched = prefetch
    assert steps > 3
