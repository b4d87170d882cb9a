"""sample_draft: q rows are what the tokens were drawn from; Triton == reference."""

import numpy as np
import scipy.stats
import torch

from specmask.kernels.backend import Backend
from specmask.kernels.draft_sampling import sample_draft
from tests.kernels.helpers import sampling

P_MIN = 1e-4


def test_triton_matches_reference_and_greedy_is_one_hot():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 128001, generator=gen)
    logits[:, 5000:] = float("-inf")  # draft-side grammar mask
    params = sampling([0.0, 1.0, 0.6, 1.0], top_k=[0, 0, 20, 0], top_p=[1.0, 1.0, 1.0, 0.8], seeds=[1, 2, 3, 4])
    tokens_t, probs_t = sample_draft(logits, params, position=2, backend=Backend.TRITON)
    tokens_r, probs_r = sample_draft(logits, params, position=2, backend=Backend.REFERENCE)
    assert torch.equal(tokens_t, tokens_r) and torch.equal(probs_t, probs_r)
    assert int(tokens_r[0]) == int(logits[0].argmax())
    assert probs_r[0, tokens_r[0]] == 1.0 and probs_r[0].sum() == 1.0
    assert (tokens_r < 5000).all() and (probs_r[:, 5000:] == 0).all()
    assert (probs_r[tokens_r.new_tensor(range(4)), tokens_r] > 0).all()
    torch.testing.assert_close(probs_r.sum(-1), torch.ones(4))


def test_positions_draw_fresh_noise_and_seeds_reproduce():
    logits = torch.zeros(64, 1000)  # uniform q: any reuse of noise would show
    params = sampling([1.0] * 64, seeds=list(range(64)))
    first, _ = sample_draft(logits, params, position=1, backend=Backend.REFERENCE)
    again, _ = sample_draft(logits, params, position=1, backend=Backend.REFERENCE)
    second, _ = sample_draft(logits, params, position=2, backend=Backend.REFERENCE)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)


def test_draft_tokens_follow_q():
    num_requests, vocab = 20000, 7
    gen = torch.Generator().manual_seed(5)
    row = torch.randn(vocab, generator=gen)
    params = sampling([0.8] * num_requests, top_k=[5] * num_requests, seeds=list(range(num_requests)))
    tokens, probs = sample_draft(row.repeat(num_requests, 1), params, backend=Backend.REFERENCE)
    q = probs[0].double().numpy()
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    assert counts[q == 0].sum() == 0
    keep = q > 0
    assert scipy.stats.chisquare(counts[keep], q[keep] / q[keep].sum() * num_requests).pvalue > P_MIN


def test_min_p_shapes_q_and_the_draws_identically_on_both_backends():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 1001, generator=gen) * 3  # odd vocabulary width
    logits[:, 700:] = float("-inf")  # draft-side grammar mask
    params = sampling(
        [1.0, 0.7, 0.0, 1.3, 1.0],
        top_p=[1.0, 0.9, 1.0, 1.0, 1.0],
        seeds=[1, 2, 3, 4, 5],
        min_p=[0.1, 0.05, 0.5, 0.0, 1.0],
    )
    tokens_t, probs_t = sample_draft(logits, params, position=3, backend=Backend.TRITON)
    tokens_r, probs_r = sample_draft(logits, params, position=3, backend=Backend.REFERENCE)
    assert torch.equal(tokens_t, tokens_r) and torch.equal(probs_t, probs_r)
    scaled = torch.softmax(logits / torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0]).unsqueeze(1), dim=-1)
    below = scaled < scaled.amax(-1, keepdim=True) * torch.tensor([0.1, 0.05, 0.5, 0.0, 1.0]).unsqueeze(1)
    assert (probs_r[[0, 1, 3, 4]][below[[0, 1, 3, 4]]] == 0).all()  # q is zero wherever min-p removed a token
    assert below[0].sum() > 0 and (probs_r[0] > 0).sum() >= 2
    assert int(tokens_r[2]) == int(logits[2].argmax())  # greedy: min-p changes nothing
    assert int(tokens_r[4]) == int(logits[4].argmax()) and probs_r[4].max() == 1.0  # min_p = 1: the top only
    torch.testing.assert_close(probs_r.sum(-1), torch.ones(5))
