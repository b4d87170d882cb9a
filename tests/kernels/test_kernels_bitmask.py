"""apply_token_bitmask(_indirect)_inplace: Triton == reference == the spec, on odd shapes."""

import pytest
import torch
import xgrammar

from specmask.kernels.backend import Backend
from specmask.kernels.bitmask import apply_token_bitmask_indirect_inplace, apply_token_bitmask_inplace
from tests.kernels.helpers import pack_bitmask, random_bitmask

NEG_INF = float("-inf")


def expected_masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The spec, spelled out: allowed[:, :V_mask] keeps, everything else -inf."""
    out = torch.full_like(logits, NEG_INF)
    num_cols = min(allowed.shape[1], logits.shape[1])
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[:, :num_cols] = allowed[:, :num_cols]
    out[keep] = logits[keep]
    return out


def run_both(logits: torch.Tensor, bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    by_triton, by_reference = logits.clone(), logits.clone()
    assert apply_token_bitmask_inplace(by_triton, bitmask, backend=Backend.TRITON) is Backend.TRITON
    assert apply_token_bitmask_inplace(by_reference, bitmask, backend=Backend.REFERENCE) is Backend.REFERENCE
    return by_triton, by_reference


@pytest.mark.parametrize(
    ("num_rows", "vocab_mask", "vocab_logits"),
    [
        (1, 128001, 128001),  # vocab not a multiple of 32, batch 1
        (3, 151665, 151936),  # Qwen2: tokenizer vocab < padded model vocab
        (2, 100, 257),  # logits much wider than the mask
        (4, 70, 33),  # mask wider than logits
    ],
)
def test_triton_matches_reference_and_spec(num_rows, vocab_mask, vocab_logits):
    gen = torch.Generator().manual_seed(vocab_mask)
    allowed = torch.rand(num_rows, vocab_mask, generator=gen) < 0.5
    allowed[0] = False  # all-zero row
    if num_rows > 1:
        allowed[1] = False
        allowed[1, vocab_mask - 1] = True  # single-token row (the last real token)
    bitmask = pack_bitmask(allowed)
    logits = torch.randn(num_rows, vocab_logits, generator=gen)
    by_triton, by_reference = run_both(logits, bitmask)
    assert torch.equal(by_triton, by_reference)
    assert torch.equal(by_reference, expected_masked(logits, allowed))


def test_non_contiguous_logits_are_masked_in_place():
    gen = torch.Generator().manual_seed(1)
    vocab = 128001
    storage = torch.randn(vocab, 3, generator=gen)
    bitmask = random_bitmask(3, vocab, gen)
    by_triton, by_reference = storage.clone().t(), storage.clone().t()  # [3, V], column stride 3
    assert not by_triton.is_contiguous()
    apply_token_bitmask_inplace(by_triton, bitmask, backend=Backend.TRITON)
    apply_token_bitmask_inplace(by_reference, bitmask, backend=Backend.REFERENCE)
    assert torch.equal(by_triton, by_reference)
    # Strided rows too: every other row of a wider batch, untouched rows stay untouched.
    wide = torch.randn(6, 300, generator=gen)
    original = wide.clone()
    view = wide[::2, 5:290]  # [3, 285]
    apply_token_bitmask_inplace(view, random_bitmask(3, 285, gen), backend=Backend.TRITON)
    assert torch.equal(wide[1::2], original[1::2])
    assert torch.equal(wide[:, :5], original[:, :5]) and torch.equal(wide[:, 290:], original[:, 290:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(dtype):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 1000, generator=gen).to(dtype)
    by_triton, by_reference = run_both(logits, random_bitmask(2, 999, gen))
    assert by_triton.dtype == dtype and torch.equal(by_triton, by_reference)


def test_indirect_matches_direct():
    gen = torch.Generator().manual_seed(3)
    vocab = 128001
    table = random_bitmask(3, vocab, gen)
    table[1] = 0  # an all-zero interned row
    row_ids = torch.tensor([2, 0, 0, 1, 2], dtype=torch.int32)
    logits = torch.randn(5, vocab + 255, generator=gen)
    direct = logits.clone()
    apply_token_bitmask_inplace(direct, table[row_ids.long()], backend=Backend.REFERENCE)
    for backend in (Backend.TRITON, Backend.REFERENCE):
        indirect = logits.clone()
        assert apply_token_bitmask_indirect_inplace(indirect, table, row_ids, backend=backend) is backend
        assert torch.equal(indirect, direct)


def test_default_backend_under_interpreter_is_triton():
    logits = torch.zeros(1, 64)
    assert apply_token_bitmask_inplace(logits, torch.zeros(1, 2, dtype=torch.int32)) is Backend.TRITON
    assert torch.isinf(logits).all()


def test_agrees_with_xgrammar():
    gen = torch.Generator().manual_seed(4)
    vocab = 32000
    bitmask = random_bitmask(4, vocab, gen)
    logits = torch.randn(4, vocab, generator=gen)
    ours, theirs = logits.clone(), logits.clone()
    apply_token_bitmask_inplace(ours, bitmask, backend=Backend.REFERENCE)
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError):
        apply_token_bitmask_inplace(torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError):
        apply_token_bitmask_inplace(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64))
