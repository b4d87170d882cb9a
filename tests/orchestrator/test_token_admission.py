"""Admission bounded in prompt tokens (orchestrator.token_admission)."""

from __future__ import annotations

import grpc
import pytest

from specmask.orchestrator.config import OrchestratorConfig
from specmask.orchestrator.errors import Overloaded
from specmask.orchestrator.token_admission import PromptTokenBounds


def test_the_queue_refuses_past_its_token_bound_with_a_retry_hint() -> None:
    bounds = PromptTokenBounds(max_queued_prompt_tokens=10_000, max_worker_prompt_tokens=0)
    bounds.check_queue(6_000, 4_000)  # exactly at the bound: admitted
    with pytest.raises(Overloaded, match="prompt tokens waiting") as refused:
        bounds.check_queue(6_000, 4_001)
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and refused.value.retry_after_s
    # Before validation the count is unknown: a queue already at its bound refuses at once.
    with pytest.raises(Overloaded):
        bounds.check_queue(10_000, 1)
    bounds.check_queue(9_999, 1)


def test_an_empty_queue_takes_any_one_request() -> None:
    PromptTokenBounds(max_queued_prompt_tokens=100).check_queue(0, 5_000)


def test_a_worker_takes_prompts_up_to_its_bound_and_one_alone_past_it() -> None:
    bounds = PromptTokenBounds(max_worker_prompt_tokens=8_000)
    assert bounds.fits_worker(4_000, 4_000)
    assert not bounds.fits_worker(4_000, 4_001)
    assert bounds.fits_worker(0, 50_000)  # an idle worker runs a prompt larger than the bound, alone


def test_zero_turns_a_bound_off_and_negative_is_refused() -> None:
    off = PromptTokenBounds(max_queued_prompt_tokens=0, max_worker_prompt_tokens=0)
    off.check_queue(10**9, 10**9)
    assert off.fits_worker(10**9, 10**9)
    with pytest.raises(ValueError, match="max_worker_prompt_tokens"):
        PromptTokenBounds(max_worker_prompt_tokens=-1)


def test_the_bounds_and_the_iteration_budget_reach_engine_and_workers() -> None:
    cfg = OrchestratorConfig(
        target_dir="/m",
        mask_service_addresses=("m:1",),
        max_iteration_tokens=256,
        max_queued_prompt_tokens=123,
        max_worker_prompt_tokens=45,
    )
    assert cfg.worker_config().max_iteration_tokens == 256
    assert cfg.prompt_token_bounds() == PromptTokenBounds(123, 45)
    # Below a full batch is allowed (rows are never dropped, only drafts); below 0 is not.
    assert OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",), max_batch=64, max_iteration_tokens=32)
    with pytest.raises(ValueError, match="max_iteration_tokens"):
        OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",), max_iteration_tokens=-1)
    with pytest.raises(ValueError, match="max_queued_prompt_tokens"):
        OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",), max_queued_prompt_tokens=-5)
