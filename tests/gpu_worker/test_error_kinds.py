"""A failed sequence's step output says what kind of failure it was (``StepOutput.error_kind``),
so the APIs report it without reading its words: here, the mask tier going away mid-generation."""

from __future__ import annotations

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.mask_errors import MASK_TIER_UNAVAILABLE
from specmask.gpu_worker.types import ErrorKind, FinishReason, NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import serving_masks, torch_threads


@pytest.mark.slow  # a model pair and a mask service of its own, and the router's deadline
def test_a_mask_tier_lost_mid_generation_fails_the_sequence_as_mask_tier_unavailable(tiny_pair, make_worker) -> None:
    with serving_masks(tiny_pair[0]) as own, torch_threads(1):
        worker = make_worker(mask_service_addresses=(f"127.0.0.1:{own.port}",), mask_deadline_s=2.0)
        seq = NewSequence(
            "long",
            (5, 6, 7),
            GrammarSpec(GrammarKind.REGEX, "[a-z]{200}"),
            SamplingParams(max_tokens=200),
            SpeculationParams(enabled=False),
        )
        assert worker.add([seq], wait_for_sessions=True) == [None]
        first = worker.step()
        assert first and first[0].finish_reason is None, first  # generating, masked by the tier
        own.stop(grace_s=0.0)
        outputs = []
        for _ in range(20):
            outputs += worker.step()
            if any(o.finish_reason is not None for o in outputs) or worker.num_active() == 0:
                break
    last = outputs[-1]
    assert last.finish_reason is FinishReason.ERROR, last
    assert last.error is not None and last.error.startswith(MASK_TIER_UNAVAILABLE), last.error
    assert last.error_kind is ErrorKind.MASK_TIER_UNAVAILABLE
    assert "127.0.0.1" not in last.error
