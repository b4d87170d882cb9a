"""Never lie on the device: tiny temperatures and non-finite rows stay inside the mask,
and the rejection sampler's mask check fails a request loudly instead of emitting a
token its mask row forbids (both backends, asserting which one ran)."""

import pytest
import torch

from specmask.kernels.backend import Backend
from specmask.kernels.bitmask import apply_token_bitmask_inplace
from specmask.kernels.draft_sampling import sample_draft
from specmask.kernels.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample
from tests.kernels.helpers import cumulative, pack_bitmask, sampling
from tests.kernels.test_kernels_rejection import make_batch

BACKENDS = (Backend.TRITON, Backend.REFERENCE)
NO_DRAFTS = torch.empty(0, dtype=torch.int64)


def only_allowed(num_rows: int, vocab: int, allowed_ids: list[int]) -> torch.Tensor:  # [num_rows, W] int32
    allowed = torch.zeros(num_rows, vocab, dtype=torch.bool)
    allowed[:, allowed_ids] = True
    return pack_bitmask(allowed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 1e-45, 1e-30])
def test_tiny_temperature_stays_in_mask(backend: Backend, temperature: float) -> None:
    """Finding 2: T = 1e-40 made logits / T infinite, softmax NaN, and token 0 (EOS) came out."""
    vocab = 97
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab, generator=gen) * 5  # [B = 4, V], k_r = 0
    logits[:, 0] = 50.0  # token 0 (a stop token) is the model's favourite but not allowed
    mask = only_allowed(4, vocab, [5, 40, 96])
    apply_token_bitmask_inplace(logits, mask, backend=Backend.REFERENCE)
    params = sampling([temperature] * 4, seeds=[1, 2, 3, 4])
    row_ids = torch.arange(4, dtype=torch.int32)
    out = rejection_sample(
        NO_DRAFTS, cumulative([0] * 4), None, logits, params, mask_table=mask, mask_row_ids=row_ids, backend=backend
    )
    assert out.backend is backend
    assert not out.violation.any()
    expected = logits.argmax(dim=-1)  # the T -> 0 limit is the masked argmax
    assert torch.equal(out.output_token_ids[:, 0], expected)

    tokens, probs = sample_draft(logits, params, backend=backend)
    assert torch.equal(tokens, expected)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_logit_row_falls_back_to_masked_argmax(backend: Backend) -> None:
    """A NaN among the allowed logits (a broken model) must not push sampling outside the mask."""
    vocab = 64
    logits = torch.zeros(2, vocab)
    logits[:, 9] = 3.0
    logits[:, 12] = float("nan")
    mask = only_allowed(2, vocab, [9, 12, 30])
    apply_token_bitmask_inplace(logits, mask, backend=Backend.REFERENCE)
    out = rejection_sample(
        NO_DRAFTS,
        cumulative([0, 0]),
        None,
        logits,
        sampling([1.0, 0.7], seeds=[5, 6]),
        mask_table=mask,
        mask_row_ids=torch.arange(2),
        backend=backend,
    )
    assert out.backend is backend
    assert not out.violation.any()
    assert out.output_token_ids[:, 0].tolist() == [9, 9]


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_mask_token_fails_only_its_request(backend: Backend) -> None:
    """Logits and mask disagree (the logits were never masked): the sampler picks a token
    the mask forbids. The check flags that request, emits nothing for it, and leaves the
    other requests of the batch alone."""
    vocab = 70  # not a multiple of 32
    num_drafts = [0, 2, 1, 0]
    num_tokens = sum(num_drafts) + len(num_drafts)
    logits = torch.full((num_tokens, vocab), -5.0)
    logits[:, 3] = 5.0  # everyone's argmax is token 3 ...
    allowed = [3] * num_tokens
    # ... but request 1's bonus row (row 3) allows only 4, and request 3's only row allows 6 and 69.
    table = torch.cat([only_allowed(1, vocab, [3]), only_allowed(1, vocab, [4]), only_allowed(1, vocab, [6, 69])])
    row_ids = torch.tensor([0, 0, 0, 1, 0, 0, 2], dtype=torch.int32)  # [num_tokens]
    assert len(allowed) == num_tokens == row_ids.shape[0]
    drafts = torch.tensor([3, 3, 3])  # request 1 drafts 3, 3 (accepted, greedy); request 2 drafts 3
    params = sampling([0.0, 0.0, 1.0, 0.0], seeds=[1, 2, 3, 4])
    out = rejection_sample(
        drafts, cumulative(num_drafts), None, logits, params, mask_table=table, mask_row_ids=row_ids, backend=backend
    )
    assert out.backend is backend
    assert out.violation.tolist() == [False, True, False, True]
    assert out.num_emitted.tolist() == [1, 0, 2, 0]
    assert (out.output_token_ids[1] == PLACEHOLDER_TOKEN_ID).all()
    assert (out.output_token_ids[3] == PLACEHOLDER_TOKEN_ID).all()
    assert out.output_token_ids[0, 0] == 3 and out.output_token_ids[2, :2].tolist() == [3, 3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_forbidden_draft_with_q_one_fails_loudly(backend: Backend) -> None:
    """A grammar-forced-style draft (q = 1) the mask forbids, with logits that still give it
    mass: the accept test would keep it; the check refuses it."""
    vocab = 40
    logits = torch.zeros(2, vocab)  # uniform target: p(d) > 0 everywhere (logits never masked)
    table = only_allowed(1, vocab, [1, 2])
    out = rejection_sample(
        torch.tensor([17]),
        cumulative([1]),
        None,
        logits,
        sampling([1.0], seeds=[11]),
        mask_table=table,
        mask_row_ids=torch.zeros(2, dtype=torch.int64),
        backend=backend,
    )
    assert out.backend is backend
    assert out.violation.tolist() == [True]
    assert out.num_emitted.tolist() == [0] and out.num_accepted.tolist() == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_past_mask_width_is_a_violation(backend: Backend) -> None:
    """A padded-vocab column (>= 32 * W) is never allowed, whatever the row says."""
    vocab = 80
    logits = torch.zeros(1, vocab)
    logits[0, 70] = 9.0
    table = torch.full((1, 2), -1, dtype=torch.int32)  # W = 2: all 64 tokens allowed
    out = rejection_sample(
        NO_DRAFTS,
        cumulative([0]),
        None,
        logits,
        sampling([0.0]),
        mask_table=table,
        mask_row_ids=torch.zeros(1, dtype=torch.int32),
        backend=backend,
    )
    assert out.backend is backend and out.violation.tolist() == [True]


@pytest.mark.parametrize("with_q", [True, False])
def test_correct_masks_never_flag_and_backends_agree(with_q: bool) -> None:
    """With logits masked by the same rows, the check passes and changes nothing."""
    num_drafts = [3, 0, 5, 1, 2]
    draft_ids, cu, q, logits, params, bitmask = make_batch(num_drafts, 1000, seed=7, with_q=with_q, mask_density=0.3)
    row_ids = torch.arange(logits.shape[0], dtype=torch.int32)
    plain = rejection_sample(draft_ids, cu, q, logits, params, backend=Backend.REFERENCE)
    results = {
        b: rejection_sample(draft_ids, cu, q, logits, params, mask_table=bitmask, mask_row_ids=row_ids, backend=b)
        for b in BACKENDS
    }
    for backend, out in results.items():
        assert out.backend is backend
        assert not out.violation.any()
        assert torch.equal(out.output_token_ids, plain.output_token_ids)
        assert torch.equal(out.num_emitted, plain.num_emitted)


def test_mask_arguments_go_together() -> None:
    logits = torch.zeros(1, 32)
    with pytest.raises(ValueError, match="go together"):
        rejection_sample(NO_DRAFTS, cumulative([0]), None, logits, sampling([0.0]), mask_table=torch.zeros(1, 1))
