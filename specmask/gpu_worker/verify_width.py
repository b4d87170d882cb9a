"""The step's verify widths: how many of each row's proposed drafts the target forward checks.

Owns ``WidthChooser``: per (draft source, depth) acceptance rates learned from this worker's
steps, and the per-row trim after proposal that keeps the drafts whose expected gain beats
the kept set's tokens per unit of verify cost (``FIXED_POSITIONS`` + positions). Trimming
never changes an output. The rule and why unmeasured depths are priced as accepted:
docs/design.md, "Choosing verify widths".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specmask.gpu_worker.proposers.base import DraftSlot

# A step's fixed cost in units of one verified (row, token) position: weights
# read once per forward, attention, drafting, mask round trips and sampling.
# Fitted with the packed forward on a 2-core CPU (bench.kv --model
# smollm2-135m-instruct --batch 9 --length 500 --layouts packed --threads 2,
# every row 1 vs 5 tokens wide, plus the step's work outside the forward), the
# step alone is worth about 24 positions. It is set higher because the fit
# prices only this step: a larger fixed cost keeps more drafts, which also keeps
# tokens per target forward up (fewer steps per request), and bench.e2e on
# SmolLM2 (grammar-forced + n-gram drafts) ran at least as fast with 40 as with
# 24, within noise of 60 (docs/benchmarks.md).
FIXED_POSITIONS = 40.0
# The same on a GPU. A forward there reads every weight once whatever its width, and one
# more position costs its FLOPs: a position is worth (FLOP rate / memory bandwidth) /
# (FLOPs per weight byte = 1 in bf16) of the weights' read, so the weights alone are worth the
# chip's ridge point in positions, about 190 on an H200 and 300 on an H100 (bf16). The
# step's host work adds to it, and the static forward pads every row to the batch's width
# bucket anyway (static_forward.WIDTH_BUCKETS): trimming one row saves nothing unless every
# row drops below a bucket.
GPU_FIXED_POSITIONS = 256.0
# Prior pseudo-counts (accepted, reached) added to every (source, depth) estimate.
_PRIOR = (1.0, 2.0)
# Per step, every count fades: the estimate follows the current requests, and a
# depth the chooser stopped verifying drifts back to the prior and is tried again.
_DECAY = 0.98
# Never below this many drafts per row where they were proposed: depth 1 keeps being measured.
MIN_DRAFTS = 1
# A (source, depth) whose faded count of drafts reaching it is below this is unmeasured.
MEASURED = 1.0


@dataclass
class WidthChooser:
    """Learns per-source conditional acceptance and trims each slot's drafts to its best count."""

    fixed_positions: float = FIXED_POSITIONS
    # (source, depth) -> [accepted, reached]: drafts of this source at this depth (1-based)
    # accepted / reached (all drafts before them accepted).
    stats: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    @classmethod
    def for_device(cls, device_type: str) -> WidthChooser:
        """A chooser with the fixed step cost of a device type ("cuda", "cpu", ...)."""
        return cls(fixed_positions=GPU_FIXED_POSITIONS if device_type == "cuda" else FIXED_POSITIONS)

    def rate(self, source: str, depth: int) -> float:
        """The estimated acceptance of a draft from ``source`` at ``depth`` once the ones before it were."""
        accepted, reached = self.stats.get((source, depth), (0.0, 0.0))
        return (accepted + _PRIOR[0]) / (reached + _PRIOR[1])

    def pricing_rate(self, source: str, depth: int) -> float:
        """The rate the choice prices a draft at: ``rate``, or 1 while unmeasured (see the module doc)."""
        reached = self.stats.get((source, depth), (0.0, 0.0))[1]
        return self.rate(source, depth) if reached >= MEASURED else 1.0

    def choose(self, slots: Sequence[DraftSlot]) -> list[int]:
        """Per slot, how many of its drafts to verify (k_r)."""
        keep = [min(s.num_drafts, MIN_DRAFTS) for s in slots]
        expected = float(len(slots))  # every row yields at least one token
        cost = self.fixed_positions + len(slots) + sum(keep)
        candidates: list[tuple[float, int, int]] = []  # (gain, depth, slot index) beyond the minimum
        for i, s in enumerate(slots):
            chance = 1.0
            for j, source in enumerate(s.sources, start=1):
                chance *= self.pricing_rate(source, j)
                if j <= keep[i]:
                    expected += chance
                else:
                    candidates.append((chance, j, i))
        # Highest gain first; equal gains by depth, so a row's drafts are taken in order
        # (gains never rise with depth).
        candidates.sort(key=lambda c: (-c[0], c[1]))
        for gain, depth, i in candidates:
            if gain <= expected / cost:
                break  # every later gain is smaller still: nothing more pays
            if depth != keep[i] + 1:
                continue  # unreachable while gains fall with depth; keeps kept drafts a prefix
            keep[i] = depth
            expected += gain
            cost += 1.0
        return keep

    def trim(self, slots: Sequence[DraftSlot]) -> int:
        """Trim every slot to its chosen draft count; returns the number of drafts dropped."""
        for entry in self.stats.values():
            entry[0] *= _DECAY
            entry[1] *= _DECAY
        return sum(s.trim(k) for s, k in zip(slots, self.choose(slots), strict=True))

    def record(self, slot: DraftSlot, num_accepted: int) -> None:
        """Learn from one verified slot: its first ``num_accepted`` drafts were accepted."""
        for j, source in enumerate(slot.sources):
            entry = self.stats.setdefault((source, j + 1), [0.0, 0.0])
            entry[1] += 1.0
            if j < num_accepted:
                entry[0] += 1.0
            else:
                break  # later drafts were not reached
