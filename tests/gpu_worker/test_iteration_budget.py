"""The iteration token budget (WorkerConfig.max_iteration_tokens): chunked prefill beside decode.

A burst of long prompts arrives while a sequence is decoding: every ``step()`` (one
iteration) forwards at most the budget's worth of target tokens, across the running
sequence's verify row and the new prompts' prefill chunks, and the running sequence
emits in every iteration while the prompts are cached. Token-for-token equality of
chunked and unchunked prefill is in test_greedy_equivalence.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from specmask.gpu_worker.config import WorkerConfig
from specmask.gpu_worker.model_runner import ForwardItem
from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import run_to_completion, wait_sessions_open

BUDGET = 24
SPEC = SpeculationParams(k=4, proposers=("draft_model",), draft_masking=False)


def _seq(seq_id: str, prompt_len: int, max_tokens: int, spec: SpeculationParams = SPEC) -> NewSequence:
    prompt = tuple(5 + (i * 7) % 200 for i in range(prompt_len))
    return NewSequence(seq_id, prompt, None, SamplingParams(max_tokens=max_tokens), spec)


def _record_forwards(worker: Any) -> list[tuple[int, float]]:
    """Record every target forward from now on: (new tokens, their cost in budget tokens)."""
    sizes: list[tuple[int, float]] = []
    real = worker.target.forward
    cost = worker.target.cost

    def forward(items: list[ForwardItem]) -> Any:
        tokens = sum(it.length for it in items)
        sizes.append((tokens, sum(cost.span(it.kv.length, it.length) for it in items)))
        return real(items)

    worker.target.forward = forward
    return sizes


def test_a_burst_of_long_prompts_keeps_every_iteration_within_the_budget(make_worker: Any) -> None:
    """The prompts' chunks ride in the running sequence's step forward: one target forward per
    iteration, whose cost (tokens weighted by the keys they attend over) stays in the budget."""
    worker = make_worker(max_iteration_tokens=BUDGET, max_batch=8, step_prefill_tokens=4)
    running_spec = SpeculationParams(k=1, proposers=("draft_model",), draft_masking=False)
    assert worker.add([_seq("running", 6, max_tokens=240, spec=running_spec)]) == [None]
    worker.step()
    burst = [_seq(f"long{i}", 90 + 13 * i, max_tokens=3) for i in range(5)]
    assert worker.add(burst) == [None] * len(burst)
    wait_sessions_open(worker)
    sizes = _record_forwards(worker)
    per_iteration: list[tuple[int, float]] = []
    forwards: list[int] = []
    running_emitted: list[bool] = []
    finished: set[str] = set()
    tokens: dict[str, list[int]] = {s.seq_id: [] for s in burst}
    for _ in range(400):
        if all(s.seq_id in finished for s in burst):
            break
        before = len(sizes)
        outputs = worker.step()
        this = sizes[before:]
        forwards.append(len(this))
        per_iteration.append((sum(t for t, _ in this), sum(c for _, c in this)))
        running_emitted.append(any(o.seq_id == "running" and o.new_token_ids for o in outputs))
        for out in outputs:
            assert out.error is None, out.error
            tokens.setdefault(out.seq_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished.add(out.seq_id)
    assert all(s.seq_id in finished for s in burst), f"unfinished: {set(worker.active_ids())}"
    # Read in cost-sized chunks riding in another sequence's steps, the prompts decode as they
    # do when each is read in one go before its first step.
    whole = make_worker(max_batch=8)
    assert whole.add(burst, wait_for_sessions=True) == [None] * len(burst)
    alone = run_to_completion(whole)
    assert {s.seq_id: alone[s.seq_id].tokens for s in burst} == {s.seq_id: tokens[s.seq_id] for s in burst}
    assert "running" not in finished  # it kept decoding through the whole burst
    total_prompt = sum(len(s.prompt_token_ids) for s in burst)
    # The prompts could not have been cached in fewer iterations than the budget allows...
    assert len(per_iteration) >= total_prompt // BUDGET
    # ...and no iteration's forward cost more than the budget, nor fed more tokens than it.
    assert max(c for _, c in per_iteration) <= BUDGET + 1e-9, max(per_iteration)
    assert max(t for t, _ in per_iteration) <= BUDGET
    assert max(c for _, c in per_iteration) >= BUDGET // 2  # the budget was used, not left idle
    # Each prompt's late chunks attend over more keys, so fewer of their tokens fit: the cost,
    # not the token count, is what the chunks were sized by.
    assert min(t for t, _ in per_iteration) < max(t for t, _ in per_iteration)
    assert all(running_emitted), running_emitted  # a token in every iteration
    assert forwards == [1] * len(forwards), forwards  # the chunks rode in the step's forward


def test_an_idle_worker_reads_prompts_in_whole_chunks(make_worker: Any) -> None:
    """With nothing decoding, the budget protects nobody's inter-token latency: the prompts are
    read in whole chunks (IDLE_PREFILL_BUDGET), not in budget-sized forwards. Once a sequence
    decodes, the budget holds again for the prompts still being read."""
    from specmask.gpu_worker.planning import IDLE_PREFILL_BUDGET

    worker = make_worker(max_iteration_tokens=BUDGET, max_batch=8, step_prefill_tokens=4)
    burst = [_seq(f"long{i}", 200 + 11 * i, max_tokens=6) for i in range(3)]
    assert sum(len(s.prompt_token_ids) for s in burst) > IDLE_PREFILL_BUDGET > 8 * BUDGET
    assert worker.add(burst) == [None] * len(burst)
    wait_sessions_open(worker)
    sizes = _record_forwards(worker)
    worker.step()  # nothing decodes yet: one forward reads as much as a whole chunk's budget
    ((tokens, cost),) = sizes
    assert IDLE_PREFILL_BUDGET >= cost > IDLE_PREFILL_BUDGET - BUDGET and tokens > 8 * BUDGET
    kv = [worker._seqs[s.seq_id].target_kv.length for s in burst]
    assert kv[0] == 200 - 4 and kv[1] > 0 and sum(kv) == tokens, kv  # the oldest first, to its tail
    tokens_by_seq: dict[str, list[int]] = {s.seq_id: [] for s in burst}
    for _ in range(100):
        if not worker.num_active():
            break
        before = len(sizes)
        stepped = False
        for out in worker.step():
            assert out.error is None, out.error
            tokens_by_seq[out.seq_id].extend(out.new_token_ids)
            stepped = stepped or bool(out.new_token_ids)
        cost = sum(c for _, c in sizes[before:])
        # An iteration that decodes keeps to the budget (a joining sequence's tail may pass it
        # by at most half of it); one that only reads prompts may take a whole chunk.
        assert cost <= (1.5 * BUDGET if stepped else IDLE_PREFILL_BUDGET) + 1e-9, (stepped, cost)
    assert not worker.num_active()
    whole = make_worker(max_batch=8)
    assert whole.add(burst, wait_for_sessions=True) == [None] * len(burst)
    alone = run_to_completion(whole)
    assert {s.seq_id: alone[s.seq_id].tokens for s in burst} == tokens_by_seq


def test_full_decode_rows_have_their_drafts_trimmed_to_the_budget(make_worker: Any) -> None:
    """Eight running sequences asking for k=4 want 8 x 5 = 40 tokens a step; with a 24-token
    budget their drafts are cut, never their rows: every sequence still steps every iteration."""
    worker = make_worker(max_iteration_tokens=BUDGET, max_batch=8)
    seqs = [_seq(f"s{i}", 5 + i, max_tokens=30) for i in range(8)]
    assert worker.add(seqs) == [None] * len(seqs)
    started: set[str] = set()
    for _ in range(10):  # the prompt tails join the steps as the budget allows
        started |= {o.seq_id for o in worker.step() if o.new_token_ids}
        if len(started) == len(seqs):
            break
    assert len(started) == len(seqs)
    sizes = _record_forwards(worker)
    for _ in range(5):
        outputs = worker.step()
        assert {o.seq_id for o in outputs} == {s.seq_id for s in seqs}
        assert all(o.error is None and o.new_token_ids for o in outputs)
    assert max(c for _, c in sizes) <= BUDGET + 1e-9


def test_a_budget_below_a_full_batch_steps_every_row_without_drafts(make_worker: Any) -> None:
    """Rows are never dropped: eight running sequences under a 4-token budget all step every
    iteration, their drafts cut to none (each step then costs its eight rows, over the budget)."""
    worker = make_worker(max_iteration_tokens=4, max_batch=8, step_prefill_tokens=2)
    seqs = [_seq(f"s{i}", 5 + i, max_tokens=200) for i in range(8)]
    assert worker.add(seqs) == [None] * len(seqs)
    started: set[str] = set()
    for _ in range(150):  # the prompts still move (a token an iteration at least) and join one by one
        started |= {o.seq_id for o in worker.step() if o.new_token_ids}
        if len(started) == len(seqs):
            break
    assert len(started) == len(seqs)
    for _ in range(3):
        outputs = worker.step()
        assert {o.seq_id for o in outputs} == {s.seq_id for s in seqs}
        assert all(o.error is None and len(o.new_token_ids) == 1 and o.drafts_proposed == 0 for o in outputs)


def test_the_default_budget_follows_the_device() -> None:
    """0 = by device: a GPU's forward of 512 tokens takes milliseconds, a CPU's grows with them;
    an explicit budget is kept, whatever the batch size."""
    from specmask.gpu_worker.config import CPU_ITERATION_TOKENS, GPU_ITERATION_TOKENS, iteration_budget

    auto = WorkerConfig(target_dir="/m", max_batch=8)
    assert auto.max_iteration_tokens == 0
    assert iteration_budget(auto, "cuda") == GPU_ITERATION_TOKENS == 512
    assert iteration_budget(auto, "cpu") == CPU_ITERATION_TOKENS == 48
    assert iteration_budget(WorkerConfig(target_dir="/m", max_batch=100), "cpu") == 48
    assert iteration_budget(WorkerConfig(target_dir="/m", max_batch=8, max_iteration_tokens=300), "cpu") == 300
    assert iteration_budget(WorkerConfig(target_dir="/m", max_batch=16, max_iteration_tokens=8), "cpu") == 8
    with pytest.raises(ValueError, match="max_iteration_tokens"):
        WorkerConfig(target_dir="/m", max_batch=8, max_iteration_tokens=-1)


def test_the_kv_pools_grow_once_for_a_burst_not_once_per_chunk(make_worker: Any) -> None:
    """Every resize zeroes and copies the whole pool while the running sequences wait: a burst
    of long prompts grows each pool in its add, and the chunks that read them grow nothing."""
    from specmask.gpu_worker.kv_cache import SlotPool

    worker = make_worker(max_iteration_tokens=BUDGET, max_batch=8, step_prefill_tokens=4)
    assert worker.add([_seq("running", 6, max_tokens=60)]) == [None]
    worker.step()
    resizes: list[tuple[int, int]] = []
    real = SlotPool._resize

    def resize(pool: SlotPool, slots: int, capacity: int) -> None:
        resizes.append((slots, capacity))
        real(pool, slots, capacity)

    SlotPool._resize = resize  # type: ignore[method-assign,assignment]
    try:
        burst = [_seq(f"long{i}", 90 + 13 * i, max_tokens=3) for i in range(5)]
        assert worker.add(burst) == [None] * len(burst)
        assert len(resizes) == 2  # the target's pool and the draft's, once each
        wait_sessions_open(worker)
        for _ in range(60):
            worker.step()
    finally:
        SlotPool._resize = real  # type: ignore[method-assign]
    assert len(resizes) == 2, resizes
    assert worker.target.pool is not None and worker.target.pool.num_slots >= 6


@pytest.mark.parametrize("running", [True, False])
def test_a_prompt_that_cannot_be_read_fails_alone(make_worker: Any, running: bool) -> None:
    """A forward that fails on one prompt's chunk (riding in a step, or in a prefill-only
    forward with other chunks) fails that sequence only: the step goes on, the other
    prompts are read and decode, and the running sequence never sees an error."""
    worker = make_worker(max_iteration_tokens=BUDGET, max_batch=8, step_prefill_tokens=4)
    if running:
        assert worker.add([_seq("running", 6, max_tokens=200)]) == [None]
        worker.step()
    burst = [_seq(f"long{i}", 60 + 7 * i, max_tokens=3) for i in range(3)]
    assert worker.add(burst) == [None] * len(burst)
    poison = worker._seqs["long1"].target_kv
    real = worker.target.forward

    def forward(items: list[ForwardItem]) -> Any:
        if any(it.kv is poison and it.num_logits == 0 for it in items):
            raise RuntimeError("unreadable chunk")
        return real(items)

    worker.target.forward = forward
    results = run_to_completion(worker, max_steps=400) if not running else {}
    if running:
        for _ in range(400):
            outputs = worker.step()
            for out in outputs:
                r = results.setdefault(out.seq_id, type("R", (), {"tokens": [], "error": None})())
                r.tokens = [*r.tokens, *out.new_token_ids]
                if out.error:
                    r.error = out.error
            if all(s.seq_id in results and s.seq_id not in worker.active_ids() for s in burst):
                break
        assert results["running"].error is None and "running" in worker.active_ids()
    assert results["long1"].error is not None and "unreadable chunk" in results["long1"].error
    assert results["long1"].tokens == []
    for name in ("long0", "long2"):
        assert results[name].error is None and len(results[name].tokens) == 3, (name, results[name])
