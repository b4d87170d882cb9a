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
