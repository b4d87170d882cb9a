"""Device sampling parameters per batch composition, built once and reused.

A step hands the sampler the same per-row parameters (temperature, top-k, top-p, min-p, seed)
step after step while its batch keeps its rows; only the step counters move. ``SamplingCache``
keeps the device tensors of the last few compositions (the draft loop's row order and the
verifier's differ), so a call uploads one ``[B]`` tensor of step counters instead of building
every field from host lists again. Nothing is read back.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import torch

from specmask.gpu_worker.types import SamplingParams
from specmask.kernels.sampling_params import SamplingTensors

# Compositions kept (least recently used dropped first): a step uses two (the draft loop's rows,
# the verifier's), the position-by-position proposal one per set of rows still drafting.
CAPACITY = 8

# One row's fixed parameters: (temperature, top_k, top_p, min_p, seed).
SamplingRow = tuple[float, int, float, float, int]


def sampling_row(params: SamplingParams, seed: int) -> SamplingRow:
    """A request's fixed sampling parameters, with the seed its sequence draws with."""
    return (params.temperature, params.top_k, params.top_p, params.min_p, seed)


class SamplingCache:
    """``SamplingTensors`` for a batch's rows, built once per composition."""

    def __init__(self, device: torch.device, capacity: int = CAPACITY) -> None:
        self.device = device
        self.capacity = capacity
        self._built: OrderedDict[tuple[SamplingRow, ...], SamplingTensors] = OrderedDict()
        self.builds = 0  # compositions built (tests, benches)

    def tensors(self, rows: Sequence[SamplingRow], steps: Sequence[int]) -> SamplingTensors:
        """The rows' parameters on the device (``sampling_row``), with ``steps`` as their step counters."""
        if len(rows) != len(steps):
            raise ValueError(f"{len(rows)} rows, {len(steps)} step counters")
        key = tuple(rows)
        base = self._built.get(key)
        if base is None:
            base = SamplingTensors.from_lists(
                temperature=[r[0] for r in rows],
                top_k=[r[1] for r in rows],
                top_p=[r[2] for r in rows],
                seeds=[r[4] for r in rows],
                step=list(steps),
                device=self.device,
                min_p=[r[3] for r in rows],
            )
            self.builds += 1
            self._built[key] = base
            while len(self._built) > self.capacity:
                self._built.popitem(last=False)
            return base
        self._built.move_to_end(key)
        # The step counters move every step: the one upload of a call.
        return dataclasses.replace(base, step=torch.tensor(list(steps), dtype=torch.int64, device=self.device))
