"""expand_sampling_params (Triton == reference) and logits_to_probs semantics."""

import torch

from specmask.kernels.backend import Backend
from specmask.kernels.probs import logits_to_probs
from specmask.kernels.sampling_params import expand_sampling_params
from tests.kernels.helpers import cumulative, sampling


def test_expand_triton_matches_reference_with_ragged_k():
    num_drafts = [0, 3, 0, 20, 1]  # k = 0 requests and one longer than a Triton block
    cu = cumulative(num_drafts)
    params = sampling([0.0, 0.5, 1.0, 0.7, 2.0], [0, 5, 0, 1, 7], [1.0, 0.9, 0.5, 1.0, 0.1])
    num_tokens = sum(num_drafts) + len(num_drafts)
    by_triton, ran = expand_sampling_params(params, cu, num_tokens, backend=Backend.TRITON)
    by_reference, ran_ref = expand_sampling_params(params, cu, num_tokens, backend=Backend.REFERENCE)
    assert (ran, ran_ref) == (Backend.TRITON, Backend.REFERENCE)
    expected_request = torch.tensor([0] + [1] * 4 + [2] + [3] * 21 + [4] * 2, dtype=torch.int32)
    for rows in (by_triton, by_reference):
        assert torch.equal(rows.request_index, expected_request)
        assert torch.equal(rows.temperature, params.temperature[expected_request.long()])
        assert torch.equal(rows.top_k, params.top_k[expected_request.long()])
        assert torch.equal(rows.top_p, params.top_p[expected_request.long()])
        assert rows.temperature.dtype == torch.float32 and rows.top_k.dtype == torch.int32


def test_expand_batch_of_one_without_drafts():
    rows, _ = expand_sampling_params(sampling([1.0]), cumulative([0]), 1, backend=Backend.TRITON)
    assert rows.request_index.tolist() == [0]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]]))
    logits = torch.cat([logits, torch.full((3, 1), float("-inf"))], dim=1)  # a grammar-masked column
    probs = logits_to_probs(
        logits,
        temperature=torch.tensor([1.0, 1.0, 0.5]),
        top_k=torch.tensor([2, 0, 0], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.65, 1.0]),
    )
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.0, 3 / 7, 4 / 7, 0.0]))
    # top-p 0.65: the smallest top set with mass >= 0.65 is {0.4, 0.3}.
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 0.0, 3 / 7, 4 / 7, 0.0]))
    sharpened = torch.tensor([0.01, 0.04, 0.09, 0.16, 0.0])
    torch.testing.assert_close(probs[2], sharpened / sharpened.sum())


def test_greedy_rows_and_ties_in_top_k():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    probs = logits_to_probs(logits, torch.tensor([0.0]), torch.tensor([1], dtype=torch.int32), torch.tensor([1.0]))
    # top-k keeps ties with the k-th value (vLLM semantics); temperature 0 is treated as 1 here.
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.5, 0.5, 0.0]))


def test_expand_min_p_triton_matches_reference_on_odd_sizes():
    num_drafts = [5, 0, 17, 2, 0, 1, 33]  # odd counts, k = 0 rows, rows spanning several Triton blocks
    batch = len(num_drafts)
    cu = cumulative(num_drafts)
    min_p = [0.0, 0.05, 1.0, 0.3, 0.0, 0.999, 0.5]
    params = sampling([0.9] * batch, [0, 3, 0, 0, 2, 0, 9], [1.0, 0.8, 1.0, 0.5, 1.0, 1.0, 0.3], min_p=min_p)
    num_tokens = sum(num_drafts) + batch
    by_triton, _ = expand_sampling_params(params, cu, num_tokens, backend=Backend.TRITON)
    by_reference, _ = expand_sampling_params(params, cu, num_tokens, backend=Backend.REFERENCE)
    owner = torch.repeat_interleave(torch.arange(batch), torch.tensor(num_drafts) + 1)
    for rows in (by_triton, by_reference):
        assert rows.min_p is not None and rows.min_p.dtype == torch.float32
        assert torch.equal(rows.min_p, torch.tensor(min_p)[owner])
        assert torch.equal(rows.request_index, owner.to(torch.int32))
        assert torch.equal(rows.top_p, params.top_p[owner])


def test_min_p_off_everywhere_stays_none():
    # All zeros: no tensor, so logits_to_probs skips the pass (no softmax, no host sync).
    params = sampling([1.0, 0.5], min_p=[0.0, 0.0])
    assert params.min_p is None
    for backend in (Backend.TRITON, Backend.REFERENCE):
        rows, _ = expand_sampling_params(params, cumulative([2, 1]), 5, backend=backend)
        assert rows.min_p is None


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_allowed_probability():
    probs_in = torch.tensor([0.05, 0.15, 0.3, 0.5])
    logits = torch.cat([probs_in.log(), torch.tensor([5.0])]).repeat(4, 1)  # [4, 5]
    logits[:, 4] = float("-inf")  # grammar-masked (the largest logit): min_p sees allowed tokens only
    probs = logits_to_probs(
        logits,
        temperature=torch.tensor([1.0, 1.0, 1.0, 0.5]),
        top_k=torch.zeros(4, dtype=torch.int32),
        top_p=torch.ones(4),
        min_p=torch.tensor([0.3, 0.6, 1.0, 0.3]),
    )
    # 0.3 * 0.5 = 0.15: 0.15 is kept (vLLM drops only strictly smaller ones), 0.05 dropped.
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.15, 0.3, 0.5, 0.0]) / 0.95)
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 0.0, 0.3, 0.5, 0.0]) / 0.8)
    torch.testing.assert_close(probs[2], torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0]))  # min_p = 1: the top only
    # Temperature first: at T = 0.5 the probabilities are squared, 0.3^2/0.5^2 = 0.36 >= 0.3 but
    # 0.15^2/0.5^2 = 0.09 < 0.3, so the same min_p keeps fewer tokens than at T = 1.
    sharpened = torch.tensor([0.0, 0.0, 0.09, 0.25, 0.0])
    torch.testing.assert_close(probs[3], sharpened / sharpened.sum())


def test_min_p_comes_before_top_p():
    # vLLM's order: temperature, min-p, top-k/top-p. Here the orders disagree: min-p first drops
    # 0.1 and 0.2 (below 0.6 * 0.4), so top-p 0.5 then sees {0.3, 0.4} renormalised (0.43, 0.57)
    # and keeps only 0.4; top-p first would keep {0.4, 0.3} and min-p would then keep both.
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
    probs = logits_to_probs(
        logits,
        torch.tensor([1.0]),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([0.5]),
        min_p=torch.tensor([0.6]),
    )
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.0, 0.0, 1.0]))
