"""The device draft loop (``DraftModelProposer.draft_on_device``) drafts what position-by-position
proposal drafts: the same tokens and q rows for greedy and seeded sampling rows, rows of
different k_r, min_tokens suppression, with the drafts kept on the device. Through the whole
worker: test_greedy_equivalence.py ("draft_blind"), test_distribution.py ("blind"),
test_host_path.py (the reads it saves)."""

from __future__ import annotations

import pytest
import torch

from specmask.gpu_worker.kv_cache import SequenceKV
from specmask.gpu_worker.model_runner import ForwardItem, ModelRunner
from specmask.gpu_worker.proposers.base import DraftSlot, Proposal
from specmask.gpu_worker.proposers.draft_model import DraftModelProposer
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.types import NewSequence, SamplingParams
from specmask.kernels.backend import Backend

VOCAB = 97
NEVER = frozenset({VOCAB + 1})  # a stop set no draft can hit: position-by-position proposal never stops early
# Per row: (k_r, sampling). Greedy and seeded sampling rows, filters, min_tokens, k_r from 1 to 4.
ROWS = [
    (4, SamplingParams(temperature=0.0)),
    (2, SamplingParams(temperature=0.8, seed=11)),
    (4, SamplingParams(temperature=1.0, top_k=5, seed=12)),
    (1, SamplingParams(temperature=0.0, min_tokens=3, min_tokens_stop_ids=(3, 4, 5))),
    (3, SamplingParams(temperature=1.3, top_p=0.7, min_p=0.05, seed=13, min_tokens=2, min_tokens_stop_ids=(7,))),
]


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return _tiny_llama()


def _slots(runner: ModelRunner, rows: list[tuple[int, SamplingParams]]) -> list[DraftSlot]:
    slots = []
    for i, (k, sampling) in enumerate(rows):
        prompt = [(7 * i + j) % VOCAB for j in range(5 + i)]
        seq = SequenceState(
            NewSequence(f"s{i}", tuple(prompt), None, sampling), NEVER, ("draft_model",), k, 100 + i, prompt
        )
        seq.step = 3 + i
        seq.draft_kv = SequenceKV()
        runner.forward([ForwardItem(seq.draft_kv, prompt[:-1], 0)])  # the draft cache lags by one, as after a step
        slots.append(DraftSlot(seq, k=k))
    return slots


def _position_by_position(proposer: DraftModelProposer, slots: list[DraftSlot]) -> None:
    for position in range(1, max(s.k for s in slots) + 1):
        open_slots = [s for s in slots if s.num_drafts < s.k]
        for slot, proposal in zip(open_slots, proposer.propose(open_slots, position), strict=True):
            assert proposal is not None
            slot.add(proposal, proposer.name)


@pytest.mark.parametrize("static", ["off", "on"])
def test_device_loop_drafts_what_position_by_position_proposal_drafts(model: torch.nn.Module, static: str) -> None:
    host_runner, device_runner = ModelRunner(model, static=static), ModelRunner(model, static=static)
    host = _slots(host_runner, ROWS)
    _position_by_position(DraftModelProposer(host_runner, VOCAB, Backend.REFERENCE), host)
    on_device = _slots(device_runner, ROWS)
    drafts = DraftModelProposer(device_runner, VOCAB, Backend.REFERENCE).draft_on_device(on_device)

    assert drafts.probs is not None and drafts.probs.shape == (len(ROWS), 4, VOCAB)
    for h, d in zip(host, on_device, strict=True):
        assert d.device is drafts and d.drafts == [] and d.num_drafts == d.k == h.num_drafts
        assert d.sources == h.sources
        d.read_device()
        assert d.drafts == h.drafts, d.seq.seq_id
        for j, q in enumerate(h.q_rows):
            got = drafts.probs[d.device_row, j]
            if q is None:  # greedy: one-hot at the draft
                assert got.argmax().item() == h.drafts[j] and got.sum().item() == 1.0
            else:
                torch.testing.assert_close(got, q, atol=1e-6, rtol=0)
        # The draft cache took d_1..d_{k-1}, as position-by-position proposal leaves it.
        assert d.seq.draft_kv is not None and h.seq.draft_kv is not None
        assert d.seq.draft_kv.length == h.seq.draft_kv.length == len(d.seq.token_ids) + d.k - 1
    # min_tokens: no suppressed id where the row's output position came before the minimum.
    assert not {3, 4, 5} & set(on_device[3].drafts[:3])
    assert 7 not in on_device[4].drafts[:2]


def test_all_greedy_loop_keeps_no_q_rows(model: torch.nn.Module) -> None:
    runner = ModelRunner(model)
    slots = _slots(runner, [(3, SamplingParams()), (2, SamplingParams())])
    drafts = DraftModelProposer(runner, VOCAB, Backend.REFERENCE).draft_on_device(slots)
    assert drafts.probs is None and drafts.tokens.shape == (2, 3)


def test_device_drafts_are_read_once_and_cut_to_each_slot(model: torch.nn.Module) -> None:
    runner = ModelRunner(model)
    slots = _slots(runner, [(1, SamplingParams()), (3, SamplingParams())])
    drafts = DraftModelProposer(runner, VOCAB, Backend.REFERENCE).draft_on_device(slots)
    # Rows are ordered by k_r, largest first: the longer slot is row 0.
    assert [s.device_row for s in slots] == [1, 0]
    slots[1].trim(2)  # the verify width keeps two of its three
    with pytest.raises(RuntimeError, match="on the device"):
        slots[0].context()  # never a context silently missing its drafts
    for s in slots:
        s.read_device()
    host = drafts.read()
    assert drafts.read() is host  # cached: the second slot's read is not a second transfer
    assert slots[0].drafts == host[1][:1] and slots[1].drafts == host[0][:2]
    with pytest.raises(RuntimeError, match="host draft after device drafts"):
        slots[0].add(Proposal(1))
    assert slots[0].context() == [*slots[0].seq.token_ids, *host[1][:1]]


def _verify_inputs(on_device: bool) -> list:
    """Three requests (greedy, sampled, sampled with k_r = 0) verifying drafts held as a
    ``DeviceDrafts`` batch (rows in another order than the requests) or as host lists."""
    from specmask.gpu_worker.proposers.base import DeviceDrafts
    from specmask.gpu_worker.verifier import VerifyInput

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (3, 4), generator=g)  # [n, K]
    probs = torch.softmax(torch.randn(3, 4, VOCAB, generator=g), dim=-1)  # [n, K, V]
    probs[1] = torch.nn.functional.one_hot(tokens[1], VOCAB).float()  # row 1: the greedy request's (one-hot)
    drafts = DeviceDrafts(tokens, probs)
    # (device row, k_r, temperature) per request.
    spec = [(1, 3, 0.0), (0, 4, 0.9), (2, 0, 0.7)]
    out = []
    for r, (row, k, temperature) in enumerate(spec):
        logits = torch.randn(k + 1, VOCAB, generator=g)
        logits[torch.arange(k), tokens[row, :k]] += 8.0  # the target agrees with its drafts: most are accepted
        common = dict(logits=logits, mask=None, temperature=temperature, top_k=0, top_p=1.0, seed=40 + r, step=2)
        if on_device:
            out.append(VerifyInput(drafts=(), q_rows=(), device=drafts, device_row=row, num_device=k, **common))
        else:
            q = [None if temperature == 0.0 else probs[row, j] for j in range(k)]
            out.append(VerifyInput(drafts=tokens[row, :k].tolist(), q_rows=q, **common))
    return out


def test_verify_takes_device_drafts_as_it_takes_host_drafts() -> None:
    from specmask.gpu_worker.verifier import verify

    kwargs = dict(vocab_size=VOCAB, num_mask_words=(VOCAB + 31) // 32, kernel_backend=Backend.REFERENCE)
    host = verify(_verify_inputs(False), **kwargs)
    device = verify(_verify_inputs(True), **kwargs)
    assert device == host
    assert host[0].num_accepted == 3 and host[1].num_accepted > 0  # not vacuous: drafts were accepted


def test_verify_refuses_device_and_host_drafts_in_one_batch() -> None:
    from specmask.gpu_worker.verifier import verify

    mixed = _verify_inputs(True)[:1] + _verify_inputs(False)[1:]
    with pytest.raises(ValueError, match="one device draft loop or from the host"):
        verify(mixed, vocab_size=VOCAB, num_mask_words=(VOCAB + 31) // 32, kernel_backend=Backend.REFERENCE)
