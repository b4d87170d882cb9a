"""New sequences' prompts are fed by their first step (WorkerConfig.step_prefill_tokens).

What the tokens are is tested against the independent reference in
test_greedy_equivalence.py (both ways); here, where the prompt tokens go: a short
prompt costs no prefill forward at all and rides in the first step's batched
forwards, and a long one is prefilled in chunks, within the iterations' token
budget, only up to its last ``step_prefill_tokens`` tokens.
"""

from __future__ import annotations

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.config import WorkerConfig
from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import wait_sessions_open

GRAMMAR = GrammarSpec(GrammarKind.REGEX, "(yes|no|maybe) [a-z]{1,12}")
SPEC = SpeculationParams(k=3, proposers=("draft_model",), draft_masking=False)


def _seq(seq_id: str, prompt_len: int, grammar: GrammarSpec | None = GRAMMAR) -> NewSequence:
    prompt = tuple(5 + i % 200 for i in range(prompt_len))
    return NewSequence(seq_id, prompt, grammar, SamplingParams(max_tokens=8), SPEC)


def test_short_prompts_are_fed_by_the_first_step(make_worker):
    worker = make_worker()
    running = _seq("running", 6)
    assert worker.add([running]) == [None]
    worker.step()
    target, draft = worker.target, worker.draft
    assert draft is not None
    forwards_before, positions_before = target.num_forwards, target.num_positions

    new = [_seq("a", 7), _seq("b", 11, grammar=None)]
    assert worker.add(new) == [None, None]
    assert (target.num_forwards, target.num_positions) == (forwards_before, positions_before)  # no prefill
    assert all(worker._seqs[s.seq_id].target_kv.length == 0 for s in new)
    wait_sessions_open(worker)  # else "a" would sit its first step out

    outputs = {out.seq_id: out for out in worker.step()}
    # One batched target forward for all three: the running sequence's fed tokens, and
    # each new one's whole prompt plus its drafts.
    assert target.num_forwards == forwards_before + 1
    fed_new = sum(len(s.prompt_token_ids) + outputs[s.seq_id].drafts_proposed for s in new)
    assert target.num_positions - positions_before >= fed_new + 1 + outputs["running"].drafts_proposed
    for s in new:
        out = outputs[s.seq_id]
        assert out.error is None and out.new_token_ids
        if out.finish_reason is None:
            # Everything committed is cached but the newest token (the next step feeds it).
            state = worker._seqs[s.seq_id]
            assert state.target_kv.length == len(state.token_ids) - 1


def test_a_long_prompt_is_prefilled_by_the_iterations_up_to_its_tail(make_worker):
    """add() runs no forward; the next iteration caches the long prompt up to its tail (a prefill
    chunk within the iteration budget), and the step after feeds the tail."""
    worker = make_worker(step_prefill_tokens=4)
    forwards = worker.target.num_forwards
    assert worker.add([_seq("long", 10), _seq("short", 3)]) == [None, None]
    assert worker.target.num_forwards == forwards
    assert worker._seqs["long"].prefilling and not worker._seqs["short"].prefilling
    wait_sessions_open(worker)
    outputs = {out.seq_id: out for out in worker.step()}
    assert worker._seqs["long"].target_kv.length == 10 - 4
    assert worker._seqs["long"].draft_kv.length == 10 - 4
    assert "long" not in outputs  # prefilling: no step row yet
    assert outputs["short"].error is None and outputs["short"].new_token_ids
    outputs = {out.seq_id: out for out in worker.step()}
    assert outputs["long"].error is None and outputs["long"].new_token_ids


def test_step_prefill_tokens_below_one_is_refused(tiny_pair):
    with pytest.raises(ValueError, match="step_prefill_tokens"):
        WorkerConfig(target_dir=str(tiny_pair[0]), step_prefill_tokens=0)
