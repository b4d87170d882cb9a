"""The step's host path stays vectorised (gpu_worker.host_counter): counted on the tiny pair.

Per step, outside model forwards (graph replays on a GPU):
* host reads of tensor values (device-to-host syncs on a GPU) are at most one, plus one per
  mask request that carries the step's drafts (draft-side masks, the verify-path masks);
* the torch ops dispatched do not grow with the batch: B = 64 dispatches at most 1.1x the
  ops of B = 8.
Counts, not clocks: they hold on a shared CPU box exactly as on an idle one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.host_counter import StepCount, StepCounter
from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"],
    }
)
# name -> (grammar, proposers, draft masks): the worker's step kinds.
CASES: dict[str, tuple[bool, tuple[str, ...], bool]] = {
    "unconstrained": (False, ("draft_model",), False),
    # The default proposers without a grammar: the forced proposer has no row to draft from.
    "unconstrained/draft+forced": (False, ("draft_model", "grammar_forced"), False),
    "constrained/draft-masks-off": (True, ("draft_model",), False),
    "constrained/draft-masks-on": (True, ("draft_model",), True),
    "constrained/forced+ngram": (True, ("grammar_forced", "ngram"), False),
}
MAX_OPS_RATIO = 1.1
K = 4


def counted_steps(
    worker: Any, batch: int, *, grammar: bool, proposers: tuple[str, ...], draft_masks: bool, steps: int
) -> list[tuple[StepCount, int]]:
    """``steps`` counted steps of ``batch`` greedy sequences after one uncounted one; per step its
    counts and the most drafts a row proposed."""
    spec = SpeculationParams(k=K, proposers=proposers, draft_masking=draft_masks)
    seqs = [
        NewSequence(
            f"b{batch}-{i}",
            (5, 6, 7 + i % 200, 8 + i // 200),
            GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA) if grammar else None,
            SamplingParams(temperature=0.0, max_tokens=(steps + 2) * (K + 1) + 4),
            spec,
        )
        for i in range(batch)
    ]
    assert worker.add(seqs, wait_for_sessions=True) == [None] * batch
    worker.step()
    counts = []
    with StepCounter(worker, "cpu") as counter:
        for _ in range(steps):
            outs, count = counter.step()
            assert len(outs) == batch and not any(o.error for o in outs), outs
            counts.append((count, max(o.drafts_proposed for o in outs)))
    worker.remove(worker.active_ids())
    return counts


@pytest.fixture(scope="module")
def counts(tiny_pair, mask_address) -> dict[str, dict[int, list[tuple[StepCount, int]]]]:
    """Per case and batch size (8, 64): two counted steps on one worker."""
    from specmask.gpu_worker.actor import GpuWorker
    from specmask.gpu_worker.config import WorkerConfig
    from tests.gpu_worker.helpers import torch_threads

    config = WorkerConfig(
        target_dir=str(tiny_pair[0]),
        draft_dir=str(tiny_pair[1]),
        device="cpu",
        dtype="float32",
        mask_service_addresses=(mask_address,),
        mask_deadline_s=20.0,
        max_batch=64,
        max_k=K,
        step_prefill_tokens=1,  # prompts prefilled in add(): every counted step decodes
        max_iteration_tokens=1 << 20,  # no budget trims drafts
    )
    worker = GpuWorker(config)
    try:
        with torch_threads(1):
            return {
                case: {b: counted_steps(worker, b, grammar=g, proposers=p, draft_masks=m, steps=2) for b in (8, 64)}
                for case, (g, p, m) in CASES.items()
            }
    finally:
        worker.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_step_ops_do_not_grow_with_batch(counts, case: str) -> None:
    ops = {b: max(c.ops for c, _ in steps) for b, steps in counts[case].items()}
    assert ops[64] <= MAX_OPS_RATIO * ops[8], (case, ops, counts[case][64][0][0].op_names)


@pytest.mark.parametrize("case", list(CASES))
def test_step_reads_at_most_one_per_draft_position_plus_one(counts, case: str) -> None:
    """Every read left: one batched read per draft-model position, one for the verified tokens."""
    for batch, steps in counts[case].items():
        for c, _ in steps:
            # Drafted positions, not verified drafts: the verify width may keep fewer than were drafted.
            allowed = 1 + (K if "draft_model" in CASES[case][1] else 0)
            assert c.reads <= allowed, (case, batch, c.read_sites)


@pytest.mark.parametrize("case", [case for case in CASES if case != "constrained/draft-masks-on"])
def test_step_reads_at_most_one_plus_mask_round_trips(counts, case: str) -> None:
    """Where no draft-side mask is needed, the draft model's loop keeps its tokens on the device
    (drafting.py, "The device draft loop"): the verified tokens' read is the only one, plus the
    drafts' for a verify-path mask request."""
    for batch, steps in counts[case].items():
        for c, _ in steps:
            assert c.reads <= 1 + c.round_trips, (case, batch, c.read_sites)
        # Not vacuous: the counted steps drafted (a step that decodes plainly reads once anyway).
        assert any(drafted for _, drafted in steps), (case, batch)
