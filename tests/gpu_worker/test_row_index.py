"""CPU masking from per-row token ids (gpu_worker.row_index) is bit-identical to the packed-bitmask kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specmask.gpu_worker.mask_table import DeviceMaskTable
from specmask.gpu_worker.row_index import RowIndexCache
from specmask.gpu_worker.verifier import VerifyInput, verify
from specmask.kernels.backend import Backend
from specmask.kernels.bitmask import apply_token_bitmask_inplace
from tests.gpu_worker.helpers import table_rows
from tests.kernels.helpers import random_bitmask


def _rows(vocab_size: int, num_words: int, g: torch.Generator) -> torch.Tensor:  # [8, W] int32
    """Sparse, dense, all-ones, single-token, all-zero and half-allowed rows (every kind of entry)."""
    bits = min(vocab_size, 32 * num_words)
    rows = torch.zeros(8, num_words, dtype=torch.int32)
    rows[:, : (bits + 31) // 32] = random_bitmask(8, bits, g, density=0.02)
    rows[1, : (bits + 31) // 32] = random_bitmask(1, bits, g, density=0.97)[0]
    rows[2] = -1  # all-ones, padding bits included
    rows[3] = 0
    rows[3, 1] = 1 << 7  # one token: 39
    rows[4] = 0  # never a grammar's row, but must still mask everything
    rows[5, : (bits + 31) // 32] = random_bitmask(1, bits, g, density=0.5)[0]
    rows[6, -1] = -1  # the last word all-ones: ids past V (padding bits) must be ignored
    return rows


@pytest.mark.parametrize(("vocab_size", "num_words"), [(1000, 32), (1024, 32), (900, 32)])
def test_masked_logits_equal_the_packed_kernel(vocab_size, num_words):
    """V < 32*W (padding bits, in the last word or a whole word past V) and V == 32*W."""
    g = torch.Generator().manual_seed(vocab_size)
    dense = _rows(vocab_size, num_words, g)
    mask_rows = table_rows(dense)
    picks = [0, 1, None, 2, 3, 3, 4, 5, 6, 0, 1, None]  # repeats and no-grammar rows, as in a step
    rows = [None if p is None else mask_rows[p] for p in picks]
    logits = torch.randn(len(rows), vocab_size, generator=g) * 4
    logits[0, 5] = float("nan")  # whatever a logit holds, an allowed one is left as it is
    expected = logits.clone()
    ones = torch.full((num_words,), -1, dtype=torch.int32)
    packed = torch.stack([ones if p is None else dense[p] for p in picks])
    apply_token_bitmask_inplace(expected, packed, backend=Backend.REFERENCE)

    cache = RowIndexCache()
    for _ in range(2):  # the second pass reads every row from the cache
        got = logits.clone()
        cache.mask_(got, rows)
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(expected))
    assert cache.rows_unpacked == 7  # distinct rows, unpacked once each


def test_eviction_keeps_results_exact():
    """A cache too small for the batch's rows evicts and recomputes, with the same result."""
    g = torch.Generator().manual_seed(3)
    vocab_size = 700
    dense = random_bitmask(6, vocab_size, g, density=0.3)
    rows = table_rows(dense)
    logits = torch.randn(6, vocab_size, generator=g)
    expected = logits.clone()
    apply_token_bitmask_inplace(expected, dense, backend=Backend.REFERENCE)
    cache = RowIndexCache(max_ids=300)  # fewer ids than two rows hold
    for _ in range(2):
        got = logits.clone()
        cache.mask_(got, rows)
        assert torch.equal(got, expected)
    assert cache.rows_unpacked == 12


def test_refuses_logits_it_cannot_mask_in_place():
    rows = table_rows(random_bitmask(2, 64, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError):
        RowIndexCache().mask_(torch.zeros(64, 2).t(), rows)  # not contiguous
    with pytest.raises(ValueError):
        RowIndexCache().mask_(torch.zeros(3, 64), rows)  # a row count that does not match
    with pytest.raises(ValueError):
        RowIndexCache().mask_(torch.zeros(2, 65), rows)  # more logits than the rows have bits


def test_verify_on_cpu_matches_the_triton_kernel_path():
    """verify() on the CPU reference path (row ids) and through the Triton interpreter (packed
    kernel) give the same tokens for greedy requests whose masks decide the argmax."""
    pytest.importorskip("triton")
    from specmask.kernels.backend import triton_interpret_enabled

    if not triton_interpret_enabled():
        pytest.skip("TRITON_INTERPRET=1 not set")
    g = torch.Generator().manual_seed(11)
    vocab_size = 500
    dense = random_bitmask(5, vocab_size, g, density=0.1)
    mask_rows = table_rows(dense)
    inputs = [
        VerifyInput(
            drafts=[int(np.flatnonzero(np.unpackbits(dense[0].numpy().view(np.uint8), bitorder="little"))[0])],
            q_rows=[None],
            logits=torch.randn(2, vocab_size, generator=g) * 5,
            mask=[mask_rows[0], mask_rows[1]],
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            seed=1,
            step=0,
        ),
        VerifyInput(
            drafts=[],
            q_rows=[],
            logits=torch.randn(1, vocab_size, generator=g) * 5,
            mask=None,
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            seed=2,
            step=0,
        ),
    ]
    words = (vocab_size + 31) // 32
    cpu = verify(inputs, vocab_size=vocab_size, num_mask_words=words, kernel_backend=Backend.REFERENCE)
    tri = verify(inputs, vocab_size=vocab_size, num_mask_words=words, kernel_backend=Backend.TRITON)
    assert cpu == tri


def test_verify_uses_the_row_ids_on_cpu_and_emits_only_allowed_tokens():
    """The CPU reference verify masks through the worker's row-id cache, and every greedy token
    it emits is allowed by its row (the argmax of unmasked logits would not be)."""
    g = torch.Generator().manual_seed(5)
    vocab_size = 640
    dense = random_bitmask(3, vocab_size, g, density=0.05)
    mask_rows = table_rows(dense)
    allowed = [set(np.flatnonzero(np.unpackbits(r.numpy().view(np.uint8), bitorder="little")).tolist()) for r in dense]
    table = DeviceMaskTable("cpu")
    for trial in range(20):
        logits = torch.randn(3, vocab_size, generator=g) * 5
        draft = int(torch.randint(vocab_size, (1,), generator=g))
        inp = VerifyInput(
            drafts=[draft, draft],
            q_rows=[None, None],
            logits=logits,
            mask=list(mask_rows),
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            seed=trial,
            step=0,
        )
        (res,) = verify(
            [inp],
            vocab_size=vocab_size,
            num_mask_words=(vocab_size + 31) // 32,
            kernel_backend=Backend.REFERENCE,
            mask_table=table,
        )
        assert res.violation is None
        for i, token in enumerate(res.emitted):
            assert token in allowed[i]
    assert table.row_index.rows_unpacked == 3  # each row unpacked once, then reused
