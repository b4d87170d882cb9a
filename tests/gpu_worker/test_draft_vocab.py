"""A draft whose LM head scores a subset of the vocabulary (loading.DRAFT_VOCAB_FILE).

The restricted head must give exactly the full head's logits at its ids, the
draft proposer must place them at those ids (and -inf everywhere else, so it
never proposes a token outside the subset), and a row whose allowed tokens all
lie outside the subset must propose nothing rather than a token the target
would have to reject.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from specmask.gpu_worker.kv_cache import SequenceKV
from specmask.gpu_worker.loading import DRAFT_VOCAB_FILE, read_draft_vocab, restrict_output_vocab
from specmask.gpu_worker.model_runner import ForwardItem, ModelRunner
from specmask.gpu_worker.proposers.draft_model import DraftModelProposer

VOCAB = 97
IDS = [0, 3, 4, 10, 42, 96]


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.gpu_worker.helpers import torch_threads

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]), torch_threads(1):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def _write(tmp_path: Path, ids: object) -> str:
    (tmp_path / DRAFT_VOCAB_FILE).write_text(json.dumps(ids))
    return str(tmp_path)


def test_read_draft_vocab_absent_and_valid(tmp_path: Path) -> None:
    assert read_draft_vocab(str(tmp_path), VOCAB) is None
    got = read_draft_vocab(_write(tmp_path, IDS), VOCAB)
    assert got is not None and got.dtype == torch.long and got.tolist() == IDS


@pytest.mark.parametrize(
    "ids",
    [[], [3, 1], [1, 1], [-1, 2], [5, VOCAB], [1, True], [1.0, 2], {"ids": [1]}, "1,2"],
    ids=["empty", "unsorted", "repeated", "negative", "past-vocab", "bool", "float", "object", "string"],
)
def test_read_draft_vocab_refuses_a_bad_list(tmp_path: Path, ids: object) -> None:
    with pytest.raises(ValueError, match="sorted list of distinct token ids"):
        read_draft_vocab(_write(tmp_path, ids), VOCAB)


def test_restricted_head_scores_exactly_the_full_heads_columns(model) -> None:
    ids = torch.tensor(IDS)
    small = copy.deepcopy(model)
    restrict_output_vocab(small, ids)
    # The input embedding is untouched: the restricted head was a tied one.
    assert torch.equal(small.get_input_embeddings().weight, model.get_input_embeddings().weight)
    full_runner, small_runner = ModelRunner(model), ModelRunner(small, output_ids=ids)
    assert small_runner.vocab_size == len(IDS) and full_runner.output_ids is None
    tokens = [5, 17, 3, 60, 2, 9]
    full = full_runner.forward([ForwardItem(SequenceKV(), tokens, 3)])[0]  # [3, V]
    got = small_runner.forward([ForwardItem(SequenceKV(), tokens, 3)])[0]  # [3, len(IDS)]
    torch.testing.assert_close(got, full[:, ids], atol=1e-6, rtol=0)


def test_runner_refuses_output_ids_of_another_width(model) -> None:
    with pytest.raises(ValueError, match="output ids for an LM head"):
        ModelRunner(model, output_ids=torch.tensor([1, 2]))


def test_proposer_places_columns_at_their_ids(model) -> None:
    ids = torch.tensor(IDS)
    small = copy.deepcopy(model)
    restrict_output_vocab(small, ids)
    proposer = DraftModelProposer(ModelRunner(small, output_ids=ids), vocab_size=VOCAB)
    columns = torch.arange(1.0, len(IDS) + 1).repeat(2, 1)  # [2, n]
    wide = proposer._fit_width(columns)  # [2, V]
    assert wide.shape == (2, VOCAB)
    assert torch.equal(wide[:, ids], columns)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(wide[:, outside]).all())
