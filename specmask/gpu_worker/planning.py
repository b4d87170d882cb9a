"""What one worker iteration runs, within its token budget: the scheduler, free of torch.

Sequences in (``PlanSeq``: how much of each the target has cached, how much is still to
feed, whether it may take a step row) with the iteration's budget in budget tokens
(gpu_worker.token_cost); out come the step's batch, the new sequences that join it late,
and the prompt chunks that ride in its target forward (or run alone when nothing steps).
``GpuWorker`` (gpu_worker.actor) runs the plan; nothing here touches a tensor, a model or
a mask session, so the policy is tested without models (tests/gpu_worker/test_planning.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specmask.gpu_worker.token_cost import TokenCost

# The most tokens of one prompt a forward feeds. A forward over the slot pool attends
# with an explicit [rows, 1, new_tokens, keys] mask; SDPA without a fused kernel (CPU)
# materialised it per head when whole prompts went in one padded forward: nine
# 3,000-token chat prompts took > 5 GB and over two minutes on 2 cores. Chunks of at
# most this many tokens, attended row by row in the packed forward
# (gpu_worker.attention), keep a forward at O(rows x chunk x prompt) mask bytes.
PREFILL_CHUNK_TOKENS = 512
# The budget of an iteration with nothing to step (budget tokens, gpu_worker.token_cost):
# one whole chunk at the start of a prompt, whatever the configured iteration budget.
IDLE_PREFILL_BUDGET = PREFILL_CHUNK_TOKENS


@dataclass(frozen=True)
class PlanSeq:
    """What the scheduler needs of one active sequence (a view of a ``SequenceState``)."""

    seq_id: str
    cached: int  # tokens the target's cache holds: positions 0 .. cached - 1
    length: int  # committed tokens (prompt + output); cached <= length
    # Prompt tokens cached by prefill chunks before the sequence's first step (which feeds
    # the rest, its tail); it takes no step row until ``cached`` reaches this.
    prefill_to: int
    ready: bool  # its mask session is open, or it has none: it may take a step row

    @property
    def uncached(self) -> int:
        """What its next step row feeds before any drafts: 1 once running, a prompt's tail
        before its first step."""
        return self.length - self.cached

    @property
    def prefilling(self) -> bool:
        """Its prompt is still being cached chunk by chunk: it holds a KV slot, not a step row."""
        return self.cached < self.prefill_to


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens ``start .. start + count - 1`` of one sequence, fed to the target's cache."""

    seq_id: str
    start: int
    count: int


@dataclass(frozen=True)
class IterationPlanner:
    """The token-budget policy of an iteration (docs/scheduling.md).

    ``budget``: budget tokens an iteration may cost (``config.iteration_budget``).
    ``step_tail``: the most trailing prompt tokens a new sequence's first step feeds.
    ``cost``: the target model's cost of feeding tokens at given positions.
    """

    budget: int
    step_tail: int
    cost: TokenCost

    @classmethod
    def of(cls, budget: int, step_prefill_tokens: int, cost: TokenCost) -> IterationPlanner:
        """``step_prefill_tokens`` (WorkerConfig) capped so that a new sequence's first step
        fits the budget with room for others: at most half of it, at least one token."""
        if budget < 1:
            raise ValueError(f"an iteration budget must be at least one token, got {budget}")
        return cls(budget, max(1, min(step_prefill_tokens, budget // 2)), cost)

    def tail_tokens(self, prompt_len: int) -> int:
        """How many trailing prompt tokens a new sequence's first step feeds: at most
        ``step_tail``, and few enough to cost at most half the budget (the tail of a long
        prompt attends over all of it), so that it fits beside the running rows; at least
        one (the step needs the last prompt token's logits)."""
        tail = min(self.step_tail, prompt_len)
        half = self.budget / 2
        while tail > 1 and self.cost.span(prompt_len - tail, tail) > half:
            tail -= 1
        return tail

    def feed_cost(self, s: PlanSeq, drafts: int) -> float:
        """Budget tokens of ``s``'s next step row: its uncached tokens plus ``drafts``."""
        return self.cost.span(s.cached, s.uncached + drafts)

    def step_budget(self, prefilling: bool) -> int:
        """What a step's rows may cost: a quarter of the budget is kept for prefill chunks
        while any prompt is being prefilled, so a stream of running sequences cannot starve
        them."""
        return self.budget - (self.budget // 4 if prefilling else 0)

    def idle_budget(self) -> int:
        """The budget of an iteration with nothing to step. No stream's inter-token latency is
        at stake then, so prompts are read in whole chunks: the CPU budget would cut a
        500-token prompt into a dozen forwards, each paying a forward's fixed cost again (and
        the draft's catch-up)."""
        return max(self.budget, IDLE_PREFILL_BUDGET)

    def step_batch(self, seqs: Iterable[PlanSeq], prefilling: bool) -> list[str]:
        """The sequences this iteration's step takes, in order: every running one (one
        uncached token each, plus drafts the step trims to the budget), then new ones whose
        prompt is cached up to its tail, in arrival order, while their tails fit the step's
        budget (``step_budget``). One new sequence joins every iteration even past the budget
        (by at most its tail, half the budget): running rows alone may fill it, and a sequence
        already placed here must not wait for them to finish."""
        budget = self.step_budget(prefilling)
        ready = [s for s in seqs if s.ready and not s.prefilling]
        batch = [s.seq_id for s in ready if s.uncached == 1]
        used = sum(self.feed_cost(s, 0) for s in ready if s.uncached == 1)
        joining = 0
        for s in ready:
            cost = self.feed_cost(s, 0)
            if s.uncached > 1 and (used + cost <= budget or not joining):
                batch.append(s.seq_id)
                used += cost
                joining += 1
        return batch

    def step_room(self, rows: Sequence[tuple[PlanSeq, int]], budget: int) -> float:
        """A lower bound on what a step of ``rows`` (each sequence with the drafts planned for
        it) leaves of ``budget``: drafts are trimmed to fit, and proposers may propose fewer."""
        return budget - min(budget, sum(self.feed_cost(s, drafts) for s, drafts in rows))

    def late_joiners(self, seqs: Iterable[PlanSeq], taken: set[str], room: float) -> tuple[list[str], float]:
        """The sequences whose session opened after the step began that join it now, without
        drafts, in arrival order while each one's row fits ``room``; returns them and the room
        left. ``taken``: the step's batch (never joined twice)."""
        joined: list[str] = []
        for s in seqs:
            if s.ready and not s.prefilling and s.seq_id not in taken:
                cost = self.feed_cost(s, 0)
                if cost <= room:
                    room -= cost
                    joined.append(s.seq_id)
        return joined, room

    def rider_budget(self, used: float) -> float:
        """What prompt chunks riding in a step's forward may cost, the step's rows having cost
        ``used``. The quarter kept for prefill is theirs even when the running rows alone
        cost more than the rest (many long rows): rows are never dropped, and prompts must
        not starve."""
        return max(self.budget - used, self.budget // 4)

    def plan_chunks(self, seqs: Iterable[PlanSeq], budget: float) -> list[Chunk]:
        """The next prompt chunks to cache within ``budget`` budget tokens: prompts not yet
        cached, oldest first, each chunk at most PREFILL_CHUNK_TOKENS and sized by its cost
        (a chunk late in a long prompt attends over all of it, so fewer of its tokens fit).
        The oldest gets at least one token even past the budget, so prompts never starve."""
        chunks: list[Chunk] = []
        for s in seqs:
            if not s.prefilling:
                continue
            most = min(s.prefill_to - s.cached, PREFILL_CHUNK_TOKENS)
            count = self.cost.fit(s.cached, budget, most)
            if count == 0 and not chunks:
                count = 1  # the oldest prompt always moves, whatever the running rows left
            if count == 0:
                break
            chunks.append(Chunk(s.seq_id, s.cached, count))
            budget -= self.cost.span(s.cached, count)
        return chunks


def whole_chunk(s: PlanSeq) -> Chunk:
    """``s``'s next prompt chunk with no budget to keep (prefilling every prompt before any
    step: benchmarks, replays): as much as a forward takes of one prompt."""
    return Chunk(s.seq_id, s.cached, min(s.prefill_to - s.cached, PREFILL_CHUNK_TOKENS))
