"""Proposer registry, n-gram lookup, grammar-forced detection, mask-row helpers."""

from __future__ import annotations

import pytest
import torch

from specmask.gpu_worker.proposers.base import DraftSlot, ProposerResources
from specmask.gpu_worker.proposers.grammar_forced import GrammarForcedProposer
from specmask.gpu_worker.proposers.ngram import NgramProposer, lookup_next
from specmask.gpu_worker.proposers.registry import build_proposers, order_names, registered_names
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.types import NewSequence
from tests.gpu_worker.helpers import table_rows

V = 70  # W = 3 words, last one partial


def _dense(*allowed: int) -> torch.Tensor:  # [W] int32
    row = torch.zeros((V + 31) // 32, dtype=torch.int32)
    for t in allowed:
        word = int(row[t // 32]) | (1 << (t % 32))
        row[t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return row


def _row(*allowed: int):  # a MaskRow of a real client row table
    return table_rows(_dense(*allowed).unsqueeze(0))[0]


def _slot(tokens, mask_row=None) -> DraftSlot:
    state = SequenceState(NewSequence("s", tuple(tokens), None), frozenset({0}), ("ngram",), 4, 1, list(tokens))
    return DraftSlot(state, k=4, mask_row=mask_row)


def test_registry_orders_by_priority_and_refuses_unknown():
    assert registered_names() == ["grammar_forced", "ngram", "draft_model"]
    assert order_names(["draft_model", "ngram", "grammar_forced", "ngram"]) == (
        "grammar_forced",
        "ngram",
        "draft_model",
    )
    with pytest.raises(ValueError, match="unknown proposer"):
        order_names(["draft_model", "medusa"])


def test_build_skips_draft_model_without_a_draft():
    built = build_proposers(ProposerResources(vocab_size=V, draft_runner=None, ngram_min=1, ngram_max=3))
    assert sorted(built) == ["grammar_forced", "ngram"]


@pytest.mark.parametrize("bits", [[0], [31], [32], [63], [69], [5, 6], []])
def test_mask_row_helpers(bits):
    row = _row(*bits)
    assert row.allowed_count == len(bits)
    assert row.forced_token(V) == (bits[0] if len(bits) == 1 else None)
    assert all(row.allows(t) for t in bits)
    assert not any(row.allows(t) for t in range(V) if t not in bits)


def test_forced_token_never_names_padding():
    ones = table_rows(torch.full((1, (V + 31) // 32), -1, dtype=torch.int32))[0]  # "past the stop" rows
    assert ones.slot == 0 and ones.forced_token(V) is None
    assert _row(V + 1).forced_token(V) is None  # a lone bit >= V stands for no token
    assert _row(V - 1).forced_token(V) == V - 1


def test_grammar_forced_proposes_only_single_allowed_tokens():
    proposer = GrammarForcedProposer(V)
    slots = [_slot([1, 2], _row(42)), _slot([1, 2], _row(4, 5)), _slot([1, 2], None)]
    out = proposer.propose(slots, position=1)
    assert out[0] is not None and out[0].token_id == 42 and out[0].q is None
    assert out[1] is None and out[2] is None


def test_ngram_lookup():
    assert lookup_next([1, 2, 3, 9, 1, 2, 3], 1, 4) == 9  # longest suffix [1,2,3] seen before
    assert lookup_next([1, 2, 7, 2, 8, 5, 2], 1, 4) == 8  # latest earlier occurrence of [2]
    assert lookup_next([1, 2, 3], 1, 4) is None
    assert lookup_next([4], 1, 4) is None
    assert lookup_next([5, 5], 2, 4) is None  # n_min respected


def test_ngram_respects_known_mask():
    proposer = NgramProposer(1, 3)
    assert proposer.propose([_slot([1, 2, 3, 1, 2])], 1)[0].token_id == 3
    assert proposer.propose([_slot([1, 2, 3, 1, 2], _row(4))], 1)[0] is None
