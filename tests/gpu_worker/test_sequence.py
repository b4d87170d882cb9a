"""Finish rules of SequenceState.commit (no models)."""

from __future__ import annotations

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams

STOP = 0


def _state(max_tokens: int = 10, grammar: bool = False, prompt=(5, 6, 7)) -> SequenceState:
    spec = GrammarSpec(GrammarKind.REGEX, "a+") if grammar else None
    req = NewSequence("s", tuple(prompt), spec, SamplingParams(max_tokens=max_tokens))
    state = SequenceState(req, frozenset({STOP}), (), 0, 1, list(prompt))
    if grammar:
        state.session_id = "sess"
    return state


def test_plain_commit_appends_and_queues_the_grammar_commit():
    s = _state(grammar=True)
    kept, reason = s.commit([1, 2], max_model_len=100)
    assert (kept, reason) == ([1, 2], None)
    assert s.token_ids == [5, 6, 7, 1, 2]
    assert s.next_commit() == ([1, 2], 1)
    s.commit([3], max_model_len=100)
    assert s.next_commit() == ([3], 2)


@pytest.mark.parametrize("grammar, reason", [(False, FinishReason.STOP), (True, FinishReason.GRAMMAR_COMPLETE)])
def test_stop_token_ends_output_and_is_not_returned(grammar, reason):
    s = _state(grammar=grammar)
    assert s.commit([1, STOP, 4], max_model_len=100) == ([1], reason)
    assert s.token_ids[-1] == 1


def test_max_tokens_truncates_to_budget():
    s = _state(max_tokens=4)
    assert s.commit([1, 2, 3], max_model_len=100) == ([1, 2, 3], None)
    assert s.commit([4, 5, 6], max_model_len=100) == ([4], FinishReason.LENGTH)
    assert s.num_output == 4


def test_exactly_spent_budget_is_length_unless_a_stop_follows():
    assert _state(max_tokens=2).commit([1, 2], max_model_len=100) == ([1, 2], FinishReason.LENGTH)
    assert _state(max_tokens=2).commit([1, 2, STOP], max_model_len=100) == ([1, 2], FinishReason.STOP)


def test_model_length_truncates():
    s = _state(max_tokens=50)
    assert s.commit([1, 2, 3, 4], max_model_len=5) == ([1, 2], FinishReason.LENGTH)
    assert len(s.token_ids) == 5
