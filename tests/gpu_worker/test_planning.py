"""The worker's iteration scheduler (gpu_worker.planning), without models: sequences as
``PlanSeq`` views, a real ``TokenCost``, and the plans it makes checked against the
budget rules of docs/scheduling.md. Importing it must not import torch."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

from specmask.gpu_worker import planning
from specmask.gpu_worker.planning import IDLE_PREFILL_BUDGET, PREFILL_CHUNK_TOKENS, IterationPlanner, PlanSeq
from specmask.gpu_worker.token_cost import TokenCost

FLAT = TokenCost(math.inf)  # a token costs one budget token wherever it sits
SMOL = TokenCost(3073.0)  # SmolLM2-135M's keys per token: late tokens of long prompts cost more


def running(seq_id: str, length: int = 40) -> PlanSeq:
    """A sequence past its first step: one uncached token (the one it last emitted)."""
    return PlanSeq(seq_id, cached=length - 1, length=length, prefill_to=0, ready=True)


def new(seq_id: str, prompt: int, tail: int, *, cached: int | None = None, ready: bool = True) -> PlanSeq:
    """A new sequence whose prompt is cached by chunks up to its last ``tail`` tokens."""
    prefill_to = prompt - tail
    return PlanSeq(seq_id, prefill_to if cached is None else cached, prompt, prefill_to, ready)


def test_importing_the_planner_does_not_import_torch() -> None:
    """The scheduler is policy, not tensors: a process that imports it (a test, a tool, a
    simulator) must not pay for torch."""
    code = "import sys, specmask.gpu_worker.planning; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_step_tail_is_capped_at_half_the_budget_and_at_least_one() -> None:
    assert IterationPlanner.of(48, 512, FLAT).step_tail == 24
    assert IterationPlanner.of(512, 4, FLAT).step_tail == 4
    assert IterationPlanner.of(1, 512, FLAT).step_tail == 1
    with pytest.raises(ValueError, match="at least one token"):
        IterationPlanner.of(0, 4, FLAT)


def test_a_tail_costs_at_most_half_the_budget_but_is_never_empty() -> None:
    planner = IterationPlanner.of(48, 512, SMOL)
    assert planner.tail_tokens(10) == 10  # a short prompt is fed whole by its first step
    assert planner.tail_tokens(24) == 23  # 24 tokens cost a little over 24 budget tokens: their attention
    late = planner.tail_tokens(60_000)  # each token there attends over ~60k keys: ~20 budget tokens
    assert 1 <= late < 24 and SMOL.span(60_000 - late, late) <= 24 < SMOL.span(60_000 - late - 1, late + 1)
    tight = IterationPlanner.of(2, 512, SMOL)
    assert tight.tail_tokens(1_000_000) == 1  # over half the budget, but the step needs the last token


def test_running_rows_come_first_and_one_new_sequence_joins_even_past_the_budget() -> None:
    planner = IterationPlanner.of(8, 4, FLAT)
    seqs = [new("a", 20, 4), *(running(f"r{i}") for i in range(10)), new("b", 20, 4)]
    batch = planner.step_batch(seqs, prefilling=False)
    # Ten running rows alone pass a budget of 8: none is dropped, and one new sequence joins.
    assert batch == [*(f"r{i}" for i in range(10)), "a"]


def test_new_sequences_join_in_arrival_order_while_their_tails_fit() -> None:
    planner = IterationPlanner.of(16, 4, FLAT)
    seqs = [running("r0"), running("r1"), new("a", 9, 4), new("b", 30, 4), new("c", 7, 4), new("d", 5, 4)]
    # 2 running + 4 + 4 + 4 = 14 <= 16; the fourth tail (4) would make 18.
    assert planner.step_batch(seqs, prefilling=False) == ["r0", "r1", "a", "b", "c"]


def test_a_quarter_is_kept_for_prefill_while_a_prompt_is_read() -> None:
    planner = IterationPlanner.of(16, 4, FLAT)
    assert planner.step_budget(prefilling=True) == 12 and planner.step_budget(prefilling=False) == 16
    seqs = [running("r0"), running("r1"), new("a", 9, 4), new("b", 30, 4), new("c", 7, 4)]
    # Within 12: 2 + 4 + 4 = 10; c's tail would make 14.
    assert planner.step_batch(seqs, prefilling=True) == ["r0", "r1", "a", "b"]


def test_sequences_still_opening_or_prefilling_take_no_row() -> None:
    planner = IterationPlanner.of(64, 4, FLAT)
    seqs = [
        running("r0"),
        PlanSeq("opening", cached=0, length=9, prefill_to=0, ready=False),
        new("half-read", 30, 4, cached=10),
        new("ready", 9, 4),
    ]
    assert planner.step_batch(seqs, prefilling=True) == ["r0", "ready"]
    assert planner.step_batch([], prefilling=False) == []


def test_chunks_are_oldest_first_within_the_budget_and_at_most_a_chunk_each() -> None:
    planner = IterationPlanner.of(48, 4, FLAT)
    seqs = [running("r0"), new("a", 30, 4, cached=0), new("b", 2000, 4, cached=100), new("c", 50, 4, cached=0)]
    chunks = planner.plan_chunks(seqs, 40.0)
    assert [(c.seq_id, c.start, c.count) for c in chunks] == [("a", 0, 26), ("b", 100, 14)]
    big = planner.plan_chunks(seqs, 10_000.0)
    assert [(c.seq_id, c.count) for c in big] == [("a", 26), ("b", PREFILL_CHUNK_TOKENS), ("c", 46)]


def test_the_oldest_prompt_moves_a_token_whatever_the_rows_left() -> None:
    planner = IterationPlanner.of(8, 4, FLAT)
    seqs = [new("a", 30, 4, cached=3), new("b", 30, 4, cached=0)]
    chunks = planner.plan_chunks(seqs, 0.0)
    assert [(c.seq_id, c.start, c.count) for c in chunks] == [("a", 3, 1)]
    assert planner.plan_chunks(seqs, -5.0)[0].count == 1


def test_chunks_late_in_a_long_prompt_take_fewer_tokens_for_the_same_budget() -> None:
    planner = IterationPlanner.of(64, 4, SMOL)
    early = planner.plan_chunks([new("a", 9000, 4, cached=0)], 64.0)
    late = planner.plan_chunks([new("a", 9000, 4, cached=8000)], 64.0)
    assert early[0].count > 2 * late[0].count >= 2
    for c in (early[0], late[0]):
        assert SMOL.span(c.start, c.count) <= 64.0 < SMOL.span(c.start, c.count + 1)


def test_chunk_size_follows_the_module_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that shrinks PREFILL_CHUNK_TOKENS (test_greedy_equivalence) must shrink every chunk."""
    monkeypatch.setattr(planning, "PREFILL_CHUNK_TOKENS", 2)
    planner = IterationPlanner.of(48, 4, FLAT)
    seq = new("a", 30, 4, cached=5)
    assert [c.count for c in planner.plan_chunks([seq], 100.0)] == [2]
    assert planning.whole_chunk(seq) == planning.Chunk("a", 5, 2)


def test_whole_chunks_stop_at_the_tail() -> None:
    seq = new("a", 1000, 4, cached=600)
    assert planning.whole_chunk(seq) == planning.Chunk("a", 600, 1000 - 4 - 600)
    assert planning.whole_chunk(new("b", 5000, 4, cached=0)).count == PREFILL_CHUNK_TOKENS


def test_riders_keep_their_quarter_even_behind_costly_rows() -> None:
    planner = IterationPlanner.of(48, 4, FLAT)
    assert planner.rider_budget(10.0) == 38.0
    assert planner.rider_budget(1000.0) == 12  # rows are never dropped; prompts never starve
    assert planner.idle_budget() == IDLE_PREFILL_BUDGET
    assert IterationPlanner.of(4096, 4, FLAT).idle_budget() == 4096


def test_late_joiners_take_only_the_room_the_step_leaves() -> None:
    planner = IterationPlanner.of(32, 4, FLAT)
    batch = [running("r0"), running("r1")]
    room = planner.step_room([(s, 4) for s in batch], 32)
    assert room == 32 - 2 * 5
    seqs = [*batch, new("a", 9, 4), new("b", 9, 8), new("c", 9, 4), new("d", 9, 4, ready=False)]
    joined, left = planner.late_joiners(seqs, {"r0", "r1"}, room)
    # a (4) fits 22; b (8) fits 18; c (4) fits 10; d is still opening.
    assert joined == ["a", "b", "c"] and left == 6
    assert planner.late_joiners(seqs, {"r0", "r1", "a", "b", "c"}, 0.0) == ([], 0.0)
    assert planner.step_room([(s, 100) for s in batch], 32) == 0  # never negative


@pytest.mark.parametrize("seed", range(8))
def test_random_plans_keep_the_budget_rules(seed: int) -> None:
    """Hostile mixes (huge prompts, tiny budgets, costly attention): every plan keeps the rules
    the worker relies on, whatever the inputs."""
    rng = random.Random(seed)
    cost = rng.choice([FLAT, SMOL, TokenCost(37.5)])
    planner = IterationPlanner.of(rng.randrange(1, 600), rng.randrange(1, 700), cost)
    seqs: list[PlanSeq] = []
    for i in range(rng.randrange(0, 40)):
        prompt = rng.randrange(1, 50_000)
        tail = planner.tail_tokens(prompt)
        assert 1 <= tail <= min(prompt, planner.step_tail)
        kind = rng.random()
        if kind < 0.4:
            seqs.append(running(f"s{i}", prompt + rng.randrange(1, 300)))
        else:
            seqs.append(new(f"s{i}", prompt, tail, cached=rng.randrange(0, prompt - tail + 1), ready=kind < 0.9))
    prefilling = any(s.prefilling for s in seqs)
    batch = planner.step_batch(seqs, prefilling)
    by_id = {s.seq_id: s for s in seqs}
    assert len(set(batch)) == len(batch)
    assert all(by_id[i].ready and not by_id[i].prefilling for i in batch)
    assert {s.seq_id for s in seqs if s.ready and s.uncached == 1} <= set(batch)  # no running row dropped
    joining = [i for i in batch if by_id[i].uncached > 1]
    if len(joining) > 1:  # past the first joiner, every joiner fits the step's budget
        assert sum(planner.feed_cost(by_id[i], 0) for i in batch) <= planner.step_budget(prefilling) + 1e-9
    budget = rng.uniform(-10, 2 * planner.budget)
    chunks = planner.plan_chunks(seqs, budget)
    assert len({c.seq_id for c in chunks}) == len(chunks)
    for c in chunks:
        s = by_id[c.seq_id]
        assert s.prefilling and c.start == s.cached
        assert 1 <= c.count <= min(PREFILL_CHUNK_TOKENS, s.prefill_to - c.start)
    if len(chunks) > 1 or (chunks and budget >= cost.span(chunks[0].start, 1)):
        assert sum(cost.span(c.start, c.count) for c in chunks) <= budget + 1e-6
    order = [s.seq_id for s in seqs if s.prefilling]
    assert [c.seq_id for c in chunks] == order[: len(chunks)]  # oldest first, none skipped
