"""Rejection sampling is exact (Leviathan et al. 2023, Theorem 1), checked statistically.

Setup: a tiny vocabulary and a "target model" whose distribution depends on
the position only, so sequential sampling gives x_1 ~ p_0, x_2 ~ p_1 (all
masked, temperature-processed). Many independent requests (one seed each) run
in one batched call on the reference backend; a smaller batch checks the
Triton kernels make the same decisions. Every test uses fixed seeds, and a
failure needs a p-value below P_MIN = 1e-4, so a correct implementation fails
with probability < 1e-4 per check for *some* seed and, with the seeds fixed,
never flakes.
"""

import math

import numpy as np
import pytest
import scipy.stats
import torch

from specmask.kernels.backend import Backend
from specmask.kernels.bitmask import apply_token_bitmask_inplace
from specmask.kernels.probs import logits_to_probs
from specmask.kernels.rejection import rejection_sample
from tests.kernels.helpers import cumulative, pack_bitmask, sampling

P_MIN = 1e-4
NUM_REQUESTS = 20000
VOCAB = 6


def position_model(num_positions: int, seed: int, *, masked: bool):
    """Target logits [num_positions, V] (grammar-masked when asked) and draft q [num_positions, V]."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_positions, VOCAB, generator=gen)
    if masked:
        allowed = torch.rand(num_positions, VOCAB, generator=gen) < 0.6
        allowed[:, 0] = True  # never an empty row (docs/design.md step 2)
        apply_token_bitmask_inplace(logits, pack_bitmask(allowed), backend=Backend.REFERENCE)
    # The draft model ignores the grammar: it proposes forbidden tokens too.
    q = torch.softmax(torch.randn(num_positions, VOCAB, generator=gen), dim=-1)
    return logits, q


def run_step(
    logits,
    q,
    first_position,
    num_drafts,
    step,
    *,
    fixed_drafts=None,
    params=None,
    backend=Backend.REFERENCE,
    num_requests=NUM_REQUESTS,
):
    """One verification step for every request at positions first_position..first_position+k."""
    positions = torch.arange(first_position, first_position + num_drafts + 1)
    target = logits[positions].repeat(num_requests, 1)  # [N*(k+1), V], request-major
    draft_q = q[positions[:-1]].repeat(num_requests, 1)  # [N*k, V]
    gen = torch.Generator().manual_seed(1000 + step)
    if fixed_drafts is None:
        draft_ids = (
            torch.multinomial(draft_q, 1, generator=gen).squeeze(1) if num_drafts else torch.empty(0, dtype=torch.long)
        )
        draft_probs = draft_q
    else:  # a proposer without a distribution (n-gram, grammar-forced): q = 1
        draft_ids = torch.tensor(fixed_drafts[first_position : first_position + num_drafts]).repeat(num_requests)
        draft_probs = None
    if params is None:
        params = sampling([1.0] * num_requests, seeds=list(range(num_requests)), step=[step] * num_requests)
    cu = cumulative([num_drafts] * num_requests)
    return rejection_sample(draft_ids, cu, draft_probs, target, params, backend=backend)


def chi_square_p_value(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    observed, expected_probs = observed.ravel(), expected_probs.ravel()
    # Impossible outcomes must never occur: that is exactness, not statistics.
    assert observed[expected_probs == 0].sum() == 0, "a token with target probability 0 was emitted"
    keep = expected_probs > 0
    expected = expected_probs[keep] * observed.sum()
    return scipy.stats.chisquare(observed[keep], expected * observed[keep].sum() / expected.sum()).pvalue


def first_two_tokens(logits, q, num_drafts, **kwargs):
    first = run_step(logits, q, 0, num_drafts, step=0, **kwargs)
    tokens = first.output_token_ids
    second = tokens[:, 1].clone()
    needs_next_step = first.num_emitted == 1
    # Requests that emitted one token take a second step from position 1 (fresh randomness: step 1).
    nxt = run_step(logits, q, 1, num_drafts, step=1, **kwargs)
    second[needs_next_step] = nxt.output_token_ids[needs_next_step, 0]
    return tokens[:, 0], second


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("with_q", [True, False])
def test_first_and_first_two_tokens_follow_the_masked_target(masked, with_q):
    num_drafts = 2
    logits, q = position_model(num_drafts + 2, seed=int(masked) * 2 + int(with_q), masked=masked)
    fixed = None if with_q else [1, 3, 2, 4]  # under the mask, some of these are forbidden
    x1, x2 = first_two_tokens(logits, q, num_drafts, fixed_drafts=fixed)
    p = torch.softmax(logits, dim=-1).double().numpy()  # [positions, V] masked target
    first_counts = np.bincount(x1.numpy(), minlength=VOCAB)
    assert chi_square_p_value(first_counts, p[0]) > P_MIN
    pair_counts = np.bincount((x1 * VOCAB + x2).numpy(), minlength=VOCAB * VOCAB)
    assert chi_square_p_value(pair_counts, np.outer(p[0], p[1])) > P_MIN


def test_temperature_top_k_top_p_are_applied_to_the_target():
    logits, q = position_model(3, seed=17, masked=True)
    params = sampling(
        [0.7] * NUM_REQUESTS, top_k=[3] * NUM_REQUESTS, top_p=[0.95] * NUM_REQUESTS, seeds=list(range(NUM_REQUESTS))
    )
    out = run_step(logits, q, 0, 2, step=0, params=params)
    processed = logits_to_probs(
        logits[:1], torch.tensor([0.7]), torch.tensor([3], dtype=torch.int32), torch.tensor([0.95])
    )
    assert (processed[0] == 0).sum() >= 3  # the filter really removed tokens
    counts = np.bincount(out.output_token_ids[:, 0].numpy(), minlength=VOCAB)
    assert chi_square_p_value(counts, processed[0].double().numpy()) > P_MIN


@pytest.mark.parametrize("masked", [False, True])
def test_acceptance_rate_is_sum_of_min_p_q(masked):
    logits, q = position_model(2, seed=30 + int(masked), masked=masked)
    out = run_step(logits, q, 0, 1, step=0)
    alpha = float(torch.minimum(torch.softmax(logits[0], -1), q[0]).sum())
    accepted = int(out.num_accepted.sum())
    assert scipy.stats.binomtest(accepted, NUM_REQUESTS, alpha).pvalue > P_MIN


@pytest.mark.parametrize("num_drafts", [1, 4])
def test_expected_tokens_per_step(num_drafts):
    # Same p and q at every position, so alpha is the same everywhere.
    logits, q = position_model(1, seed=40 + num_drafts, masked=True)
    logits, q = logits.repeat(num_drafts + 1, 1), q.repeat(num_drafts + 1, 1)
    out = run_step(logits, q, 0, num_drafts, step=0)
    alpha = float(torch.minimum(torch.softmax(logits[0], -1), q[0]).sum())
    expected = (1 - alpha ** (num_drafts + 1)) / (1 - alpha)
    emitted = out.num_emitted.double()
    z = (float(emitted.mean()) - expected) / (float(emitted.std()) / math.sqrt(NUM_REQUESTS))
    assert 2 * scipy.stats.norm.sf(abs(z)) > P_MIN


def test_triton_makes_the_same_decisions():
    logits, q = position_model(4, seed=50, masked=True)
    for fixed in (None, [1, 3, 2, 4]):
        by_triton, by_reference = (
            run_step(
                logits,
                q,
                0,
                2,
                step=0,
                fixed_drafts=fixed,
                backend=backend,
                num_requests=120,
                params=sampling([1.0, 0.0, 0.8] * 40, seeds=list(range(120)), step=[0] * 120),
            )
            for backend in (Backend.TRITON, Backend.REFERENCE)
        )
        assert torch.equal(by_triton.output_token_ids, by_reference.output_token_ids)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("draft", ["processed_q", "raw_q", "fixed"])
def test_min_p_speculative_tokens_follow_the_processed_target(masked, draft):
    """With min-p (and temperature, top-p) the first two tokens follow the processed target.
    ``processed_q``: the draft went through the same processing, as the worker's draft model
    does (kernels.draft_sampling); ``raw_q``: an unprocessed draft; ``fixed``: q = 1 drafts."""
    num_drafts = 2
    num_positions = num_drafts + 2
    temperature, min_p, top_p = 0.8, 0.25, 0.97

    def process(logits: torch.Tensor) -> torch.Tensor:  # [num_positions, V] -> processed probs
        return logits_to_probs(
            logits,
            torch.full((num_positions,), temperature),
            torch.zeros(num_positions, dtype=torch.int32),
            torch.full((num_positions,), top_p),
            min_p=torch.full((num_positions,), min_p),
        )

    def informative(seed: int) -> bool:  # >= 2 tokens left at the first two positions, some removed
        logits, _ = position_model(num_positions, seed=seed, masked=masked)
        kept = (process(logits) > 0).sum(-1)
        return bool((kept[:2] >= 2).all()) and bool((kept < (logits > float("-inf")).sum(-1)).any())

    seed = next(s for s in range(60 + len(draft), 1000, 7) if informative(s))  # deterministic
    logits, q = position_model(num_positions, seed=seed, masked=masked)
    processed = process(logits)
    if draft == "processed_q":
        q = process(torch.log(q))
    fixed = [1, 3, 2, 4] if draft == "fixed" else None
    params = sampling(
        [temperature] * NUM_REQUESTS,
        top_p=[top_p] * NUM_REQUESTS,
        seeds=list(range(NUM_REQUESTS)),
        min_p=[min_p] * NUM_REQUESTS,
    )
    first = run_step(logits, q, 0, num_drafts, step=0, fixed_drafts=fixed, params=params)
    nxt = run_step(
        logits,
        q,
        1,
        num_drafts,
        step=1,
        fixed_drafts=fixed,
        params=sampling(
            [temperature] * NUM_REQUESTS,
            top_p=[top_p] * NUM_REQUESTS,
            seeds=list(range(NUM_REQUESTS)),
            step=[1] * NUM_REQUESTS,
            min_p=[min_p] * NUM_REQUESTS,
        ),
    )
    x1 = first.output_token_ids[:, 0]
    x2 = torch.where(first.num_emitted == 1, nxt.output_token_ids[:, 0], first.output_token_ids[:, 1])
    p = processed.double().numpy()
    assert chi_square_p_value(np.bincount(x1.numpy(), minlength=VOCAB), p[0]) > P_MIN
    pair_counts = np.bincount((x1 * VOCAB + x2).numpy(), minlength=VOCAB * VOCAB)
    assert chi_square_p_value(pair_counts, np.outer(p[0], p[1])) > P_MIN


def test_triton_makes_the_same_decisions_with_min_p():
    logits, q = position_model(4, seed=70, masked=True)
    params = sampling([1.0, 0.0, 0.8] * 41, seeds=list(range(123)), min_p=[0.0, 0.3, 0.6] * 41)
    by_triton, by_reference = (
        run_step(logits, q, 0, 2, step=0, backend=backend, num_requests=123, params=params)
        for backend in (Backend.TRITON, Backend.REFERENCE)
    )
    assert torch.equal(by_triton.output_token_ids, by_reference.output_token_ids)
    assert torch.equal(by_triton.num_emitted, by_reference.num_emitted)
