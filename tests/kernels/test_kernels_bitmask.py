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


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so NaN payloads and signed zeros compare exactly."""
    return x.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[x.dtype])


def _edge_table(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[5, W] rows: all-allowed, all-disallowed, random, one token (the last), all but one.
    Returns (table, allowed [5, V] bool)."""
    gen = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(5, vocab, generator=gen) < 0.3
    allowed[0] = True
    allowed[1] = False
    allowed[3] = False
    allowed[3, vocab - 1] = True
    allowed[4] = True
    allowed[4, vocab // 2] = False
    return pack_bitmask(allowed), allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [31, 32, 1000, 49152 + 7])  # V below, at, and off a multiple of 32
@pytest.mark.parametrize("indirect", [False, True])
def test_store_only_kernel_is_bit_exact_on_edge_rows(dtype, vocab, indirect):
    """All-allowed, all-disallowed, single-token rows, V not a multiple of 32, fp32 and bf16,
    direct and indirect (with repeated row ids, int32 and int64): the Triton kernel equals
    the reference and the spec bit for bit, and allowed entries keep their exact bits (NaN
    payloads, -0.0): the kernel never rewrites them."""
    table, allowed = _edge_table(vocab)
    row_ids = torch.tensor([0, 1, 2, 3, 4, 0, 0, 1, 4, 2, 2], dtype=torch.int32)
    rows = row_ids.shape[0] if indirect else table.shape[0]
    gen = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    logits[:, ::7] = -0.0
    logits[:, 3::11] = float("nan")
    want_allowed = allowed[row_ids.long()] if indirect else allowed
    spec = logits.clone().masked_fill_(~want_allowed, NEG_INF)
    for ids in (row_ids, row_ids.long()) if indirect else (None,):
        by_backend = {}
        for backend in (Backend.TRITON, Backend.REFERENCE):
            out = logits.clone()
            if ids is None:
                apply_token_bitmask_inplace(out, table, backend=backend)
            else:
                apply_token_bitmask_indirect_inplace(out, table, ids, backend=backend)
            by_backend[backend] = out
            assert torch.equal(_bits(out), _bits(spec)), backend
        assert torch.equal(_bits(by_backend[Backend.TRITON]), _bits(by_backend[Backend.REFERENCE]))
    # The all-allowed row is untouched and the all-disallowed row is -inf everywhere.
    assert torch.equal(_bits(spec[0]), _bits(logits[0]))
    assert bool((spec[1] == NEG_INF).all())


def test_store_only_kernel_reaches_columns_past_the_mask():
    """Logits wider than 32*W (padded model vocab) are -inf past the mask, also where the
    mask's last word is all ones: the grid spans the logits, not the mask."""
    table = torch.full((2, 3), -1, dtype=torch.int32)  # 96 allowed columns
    logits = torch.randn(4, 96 + 70)
    for backend in (Backend.TRITON, Backend.REFERENCE):
        out = logits.clone()
        apply_token_bitmask_indirect_inplace(out, table, torch.tensor([1, 1, 0, 1]), backend=backend)
        assert torch.equal(out[:, :96], logits[:, :96])
        assert bool((out[:, 96:] == NEG_INF).all())
