"""``SamplingCache``: a batch composition's sampling parameters are built once; the step counters
are the call's own; a change of any parameter, seed or row order builds anew."""

from __future__ import annotations

import pytest
import torch

from specmask.gpu_worker.sampling_cache import SamplingCache, sampling_row
from specmask.gpu_worker.types import SamplingParams
from specmask.kernels.sampling_params import SamplingTensors

ROWS = [
    sampling_row(SamplingParams(temperature=0.0), 7),
    sampling_row(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1), 8),
]


def _same(a: SamplingTensors, b: SamplingTensors) -> None:
    for field in ("temperature", "top_k", "top_p", "seeds", "step", "min_p"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), field


def test_built_once_per_composition_with_each_calls_steps() -> None:
    cache = SamplingCache(torch.device("cpu"))
    first = cache.tensors(ROWS, [3, 4])
    again = cache.tensors(ROWS, [4, 5])
    assert cache.builds == 1
    assert again.temperature is first.temperature and again.seeds is first.seeds  # reused, not rebuilt
    _same(again, SamplingTensors.from_lists([0.0, 0.7], [0, 5], [1.0, 0.9], [7, 8], [4, 5], min_p=[0.0, 0.1]))
    assert first.step.tolist() == [3, 4]  # the earlier call's counters are untouched


@pytest.mark.parametrize(
    "changed",
    [
        [ROWS[1], ROWS[0]],  # row order
        [ROWS[0], (*ROWS[1][:4], 9)],  # a seed
        [ROWS[0], (0.71, *ROWS[1][1:])],  # a temperature
        [ROWS[0]],  # a row left
    ],
)
def test_any_change_builds_anew(changed) -> None:
    cache = SamplingCache(torch.device("cpu"))
    cache.tensors(ROWS, [0, 0])
    got = cache.tensors(changed, [1] * len(changed))
    assert cache.builds == 2
    _same(
        got,
        SamplingTensors.from_lists(
            [r[0] for r in changed],
            [r[1] for r in changed],
            [r[2] for r in changed],
            [r[4] for r in changed],
            [1] * len(changed),
            min_p=[r[3] for r in changed],
        ),
    )


def test_least_recently_used_composition_goes_first() -> None:
    cache = SamplingCache(torch.device("cpu"), capacity=2)
    a, b, c = [ROWS[0]], [ROWS[1]], ROWS
    cache.tensors(a, [0])
    cache.tensors(b, [0])
    cache.tensors(a, [1])  # a is now the most recent
    cache.tensors(c, [0, 0])  # evicts b
    cache.tensors(a, [2])
    assert cache.builds == 3
    cache.tensors(b, [1])
    assert cache.builds == 4


def test_rows_and_steps_must_pair() -> None:
    with pytest.raises(ValueError, match="step counters"):
        SamplingCache(torch.device("cpu")).tensors(ROWS, [1])
