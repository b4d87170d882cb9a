"""The step's verify width: how many of the proposed drafts the batched target forward checks.

Every row of the batched verify forward is padded to the widest row (its k_r + 1
tokens), and on a CPU a wider forward costs more: one sequence with four n-gram
drafts makes all B rows five wide. So after proposal the step picks one width W
for the batch and trims every slot to at most W - 1 drafts, choosing the W that
maximises expected tokens per unit of step cost:

    E(W) = Σ_r (1 + Σ_{i ≤ min(k_r, W-1)} Π_{l ≤ i} p(source of d_l, l))
    cost(W) ∝ FIXED_ROWS + B · W

where p(source, l) is the running acceptance rate of draft l when it came from
that source (grammar-forced, forced continuation, n-gram, draft model) and the
drafts before it were accepted, learned from this worker's own steps (by depth,
because acceptance is correlated: an n-gram run that matched three times tends
to match a fourth). Trimming drafts
never changes an output: verification with fewer drafts is speculative decoding
with a smaller k_r, exact for any k_r (DESIGN.md), so this is a pure cost choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpu_worker.proposers.base import DraftSlot

# A step's cost in units of one verified token position (one row × one width):
# the fixed part (weights read once per forward, drafting, mask round trips,
# sampling) is worth about this many positions. Measured on the 2-core CPU with
# SmolLM2-135M (B = 9, 500 cached tokens: 121 ms at W = 1, 233 ms at W = 5, i.e.
# ~3 ms per position over a fixed ~95 ms, plus ~25 ms of step work outside the
# forward) that is ~40; in an in-process A/B of 8 chat requests, 40 trimmed to a
# mean width of 3.3 (from 4.6) but took 4% more steps, 70 trimmed to 3.8 with
# no extra steps; both ran at about the same speed, and 70 keeps tokens per
# forward above 2 (2.13, against 1.99 with 40 and 2.31 untrimmed).
FIXED_ROWS = 70.0
# Prior pseudo-counts (accepted, reached) added to every (source, depth) estimate.
_PRIOR = (1.0, 2.0)
# Per step, every count fades: the estimate follows the current requests, and a
# depth the chooser stopped verifying drifts back to the prior and is tried again.
_DECAY = 0.98
# Never below one draft per row where one was proposed: depth 1 keeps being measured.
MIN_WIDTH = 2


@dataclass
class WidthChooser:
    """Learns per-source conditional acceptance and trims a batch's drafts to the best width."""

    fixed_rows: float = FIXED_ROWS
    # (source, depth) -> [accepted, reached]: drafts of this source at this depth (1-based)
    # accepted / reached (all drafts before them accepted).
    stats: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    def rate(self, source: str, depth: int) -> float:
        accepted, reached = self.stats.get((source, depth), (0.0, 0.0))
        return (accepted + _PRIOR[0]) / (reached + _PRIOR[1])

    def choose(self, slots: Sequence[DraftSlot]) -> int:
        """The verify width W (1 + most drafts kept per slot) for ``slots``."""
        widest = max((len(s.drafts) for s in slots), default=0)
        if widest == 0:
            return 1
        # gains[j]: expected extra accepted tokens over all slots from their j-th draft.
        gains = [0.0] * (widest + 1)
        for s in slots:
            chance = 1.0
            for j, source in enumerate(s.sources, start=1):
                chance *= self.rate(source, j)
                gains[j] += chance
        rows = float(len(slots))
        best_w, best = 1, 0.0
        expected = rows
        for j in range(1, widest + 1):
            expected += gains[j]
            value = expected / (self.fixed_rows + rows * (j + 1))
            if j + 1 <= MIN_WIDTH or value > best * (1.0 + 1e-9):
                best_w, best = j + 1, value
        return best_w

    def trim(self, slots: Sequence[DraftSlot]) -> int:
        """Trim every slot to the chosen width; returns the number of drafts dropped."""
        for entry in self.stats.values():
            entry[0] *= _DECAY
            entry[1] *= _DECAY
        width = self.choose(slots)
        dropped = 0
        for s in slots:
            if len(s.drafts) > width - 1:
                dropped += s.trim(width - 1)
        return dropped

    def record(self, slot: DraftSlot, num_accepted: int) -> None:
        """Learn from one verified slot: its first ``num_accepted`` drafts were accepted."""
        for j, source in enumerate(slot.sources):
            entry = self.stats.setdefault((source, j + 1), [0.0, 0.0])
            entry[1] += 1.0
            if j < num_accepted:
                entry[0] += 1.0
            else:
                break  # later drafts were not reached
