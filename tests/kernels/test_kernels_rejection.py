"""rejection_sample: Triton == reference on odd shapes; greedy, seeds, grammar safety."""

import pytest
import torch

from specmask.kernels.backend import Backend
from specmask.kernels.bitmask import apply_token_bitmask_inplace
from specmask.kernels.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample
from tests.kernels.helpers import cumulative, pack_bitmask, sampling


def make_batch(num_drafts, vocab, seed, *, with_q=True, mask_density=None, temperature=None):
    """Random ragged batch; drafts drawn from q (so some are accepted), masked target logits."""
    gen = torch.Generator().manual_seed(seed)
    batch, num_draft_tokens = len(num_drafts), sum(num_drafts)
    target_logits = torch.randn(num_draft_tokens + batch, vocab, generator=gen) * 4
    bitmask = None
    if mask_density is not None:
        allowed = torch.rand(num_draft_tokens + batch, vocab, generator=gen) < mask_density
        # docs/design.md step 2: a row that is used never allows nothing (that would be softmax NaN).
        allowed[torch.arange(len(allowed)), torch.randint(vocab, (len(allowed),), generator=gen)] = True
        bitmask = pack_bitmask(allowed)
        apply_token_bitmask_inplace(target_logits, bitmask, backend=Backend.REFERENCE)
    # Drafts close to the target, so acceptances and rejections both happen.
    draft_logits = torch.randn(num_draft_tokens, vocab, generator=gen) * 4
    request_of_draft = torch.repeat_interleave(torch.arange(batch), torch.tensor(num_drafts, dtype=torch.long))
    verify_rows = torch.arange(num_draft_tokens) + request_of_draft
    draft_logits = 0.3 * draft_logits + target_logits[verify_rows].clamp_min(-30)
    q = torch.softmax(draft_logits, dim=-1)
    draft_ids = (
        torch.multinomial(q, 1, generator=gen).squeeze(1) if num_draft_tokens else torch.empty(0, dtype=torch.long)
    )
    temps = temperature if temperature is not None else [0.0 if r % 3 == 0 else 1.0 for r in range(batch)]
    params = sampling(temps, seeds=[1000 + r for r in range(batch)], step=[7] * batch)
    return draft_ids, cumulative(num_drafts), (q if with_q else None), target_logits, params, bitmask


def assert_valid(out, num_drafts):
    for r, k in enumerate(num_drafts):
        n = int(out.num_emitted[r])
        assert 1 <= n <= k + 1 and int(out.num_accepted[r]) == n - 1
        assert (out.output_token_ids[r, :n] >= 0).all()
        assert (out.output_token_ids[r, n:] == PLACEHOLDER_TOKEN_ID).all()


def run_both(*args):
    by_triton = rejection_sample(*args, backend=Backend.TRITON)
    by_reference = rejection_sample(*args, backend=Backend.REFERENCE)
    assert by_triton.backend is Backend.TRITON and by_reference.backend is Backend.REFERENCE
    assert torch.equal(by_triton.output_token_ids, by_reference.output_token_ids)
    assert torch.equal(by_triton.num_accepted, by_reference.num_accepted)
    assert torch.equal(by_triton.num_emitted, by_reference.num_emitted)
    return by_reference


@pytest.mark.parametrize(
    ("num_drafts", "vocab", "with_q"),
    [
        ([3], 128001, True),  # batch 1, vocab not a multiple of 32
        ([0], 151936, True),  # k = 0: a plain decoding step
        ([2, 0, 4, 1, 0, 3], 151936, True),  # mixed k, mixed greedy/random
        ([2, 0, 4, 1, 0, 3], 1000, False),  # q = 1 (n-gram / grammar-forced drafts)
        ([0, 0, 0], 33, True),  # no drafts at all
    ],
)
def test_triton_matches_reference(num_drafts, vocab, with_q):
    draft_ids, cu, q, logits, params, _ = make_batch(num_drafts, vocab, seed=vocab + len(num_drafts), with_q=with_q)
    out = run_both(draft_ids, cu, q, logits, params)
    assert out.output_token_ids.shape == (len(num_drafts), max(num_drafts) + 1)
    assert_valid(out, num_drafts)


def test_non_contiguous_target_logits_and_top_k_top_p():
    num_drafts = [3, 0, 2]
    draft_ids, cu, q, logits, _, _ = make_batch(num_drafts, 4099, seed=5)
    strided = torch.empty(logits.shape[1], logits.shape[0]).t()  # [num_tokens, V], column stride num_tokens
    strided.copy_(logits)
    assert not strided.is_contiguous()
    params = sampling([0.8, 1.0, 0.0], top_k=[5, 0, 3], top_p=[1.0, 0.7, 0.9], seeds=[1, 2, 3])
    by_strided = run_both(draft_ids, cu, q, strided, params)
    by_contiguous = rejection_sample(draft_ids, cu, q, logits, params, backend=Backend.REFERENCE)
    assert torch.equal(by_strided.output_token_ids, by_contiguous.output_token_ids)


def test_triton_matches_reference_on_many_small_requests():
    num_drafts = [r % 5 for r in range(40)]
    draft_ids, cu, q, logits, params, _ = make_batch(num_drafts, 50, seed=11, mask_density=0.3)
    out = run_both(draft_ids, cu, q, logits, params)
    assert_valid(out, num_drafts)
    assert 0 < int(out.num_accepted.sum()) < sum(num_drafts)  # both outcomes exercised


def test_greedy_equals_sequential_argmax():
    num_drafts = [4, 0, 3, 5, 1]
    draft_ids, cu, q, logits, _, _ = make_batch(num_drafts, 300, seed=3, mask_density=0.2)
    # Make some drafts right: copy the argmax into the first two drafts of every request.
    request_of_draft = torch.repeat_interleave(torch.arange(5), torch.tensor(num_drafts))
    rows = torch.arange(len(draft_ids)) + request_of_draft
    positions = torch.arange(len(draft_ids)) - (cu.long() - torch.tensor(num_drafts))[request_of_draft]
    draft_ids = torch.where(positions < 2, logits[rows].argmax(-1), draft_ids)
    params = sampling([0.0] * 5, seeds=[9] * 5)
    out = run_both(draft_ids, cu, q, logits, params)
    start = 0
    for r, k in enumerate(num_drafts):
        target_argmax = logits[start + r : start + r + k + 1].argmax(-1)  # sequential greedy, one per position
        expected = []
        for i in range(k + 1):
            expected.append(int(target_argmax[i]))
            if i == k or int(draft_ids[start + i]) != expected[-1]:
                break
        assert out.output_token_ids[r, : len(expected)].tolist() == expected
        assert int(out.num_emitted[r]) == len(expected)
        start += k


def test_greedy_ties_pick_the_lowest_index():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0]])
    for backend in (Backend.TRITON, Backend.REFERENCE):
        out = rejection_sample(
            torch.empty(0, dtype=torch.long), cumulative([0]), None, logits, sampling([0.0]), backend=backend
        )
        assert out.output_token_ids.tolist() == [[1]]


def test_seeded_requests_reproduce_and_steps_differ():
    num_drafts = [2, 3, 1, 0]
    args = make_batch(num_drafts, 64, seed=21, temperature=[1.0] * 4)[:4]
    draft_ids, cu, q, logits = args
    runs = {}
    for step in (0, 0, 1):
        params = sampling([1.0] * 4, seeds=[5, 6, 7, 8], step=[step] * 4)
        runs.setdefault(step, []).append(rejection_sample(draft_ids, cu, q, logits, params, backend=Backend.REFERENCE))
    assert torch.equal(runs[0][0].output_token_ids, runs[0][1].output_token_ids)
    # A request's randomness depends on its own seed only, not on its batch neighbours.
    alone = rejection_sample(
        draft_ids[:2],
        cumulative([2]),
        q[:2],
        logits[:3],
        sampling([1.0], seeds=[5], step=[0]),
        backend=Backend.REFERENCE,
    )
    assert torch.equal(alone.output_token_ids[0], runs[0][0].output_token_ids[0, :3])
    many_steps = [
        rejection_sample(
            draft_ids, cu, q, logits, sampling([1.0] * 4, seeds=[5, 6, 7, 8], step=[s] * 4), backend=Backend.REFERENCE
        )
        for s in range(8)
    ]
    assert len({tuple(o.output_token_ids.flatten().tolist()) for o in many_steps}) > 1


def test_every_emitted_token_is_allowed_by_its_mask():
    """Grammar safety, including recovered and bonus tokens and drafts the mask forbids."""
    num_drafts = [r % 6 for r in range(300)]
    vocab = 40
    draft_ids, cu, q, logits, params, bitmask = make_batch(
        num_drafts, vocab, seed=8, mask_density=0.15, temperature=[[0.0, 1.0, 0.5][r % 3] for r in range(300)]
    )
    # A grammar-unaware draft model: drafts from an unmasked q regularly hit forbidden tokens.
    gen = torch.Generator().manual_seed(9)
    q = torch.softmax(torch.randn(len(draft_ids), vocab, generator=gen), dim=-1)
    draft_ids = torch.multinomial(q, 1, generator=gen).squeeze(1)
    allowed = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, :vocab].bool()
    for draft_probs in (q, None):
        out = rejection_sample(draft_ids, cu, draft_probs, logits, params, backend=Backend.REFERENCE)
        start = 0
        for r, k in enumerate(num_drafts):
            for i in range(int(out.num_emitted[r])):
                assert allowed[start + r + i, out.output_token_ids[r, i]], (r, i)
            start += k
        forbidden = ~allowed[
            torch.arange(len(draft_ids)) + torch.repeat_interleave(torch.arange(300), torch.tensor(num_drafts)),
            draft_ids,
        ]
        assert forbidden.any()  # the test really offered forbidden drafts


def test_rejects_inconsistent_shapes():
    draft_ids, cu, q, logits, params, _ = make_batch([2, 1], 16, seed=1)
    with pytest.raises(ValueError):
        rejection_sample(draft_ids, cu, q, logits[:-1], params)
    with pytest.raises(ValueError):
        rejection_sample(draft_ids, cu, q[:, :8], logits, params)
