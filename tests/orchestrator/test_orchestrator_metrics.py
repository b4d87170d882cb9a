"""The tokens_per_second histogram rates only requests long enough to span a step (issue 14)."""

from __future__ import annotations

from gpu_worker.types import FinishReason
from orchestrator.metrics import MIN_TOKENS_FOR_RATE, OrchestratorMetrics
from orchestrator.types import Usage


def _rated(metrics: OrchestratorMetrics) -> tuple[float, float]:
    count = metrics.registry.get_sample_value("specmask_request_tokens_per_second_count") or 0.0
    total = metrics.registry.get_sample_value("specmask_request_tokens_per_second_sum") or 0.0
    return count, total


def test_short_requests_are_not_rated() -> None:
    m = OrchestratorMetrics()
    # 2 tokens of one burst, 0.2 ms apart: this used to record ~5,000 tok/s
    m.observe_finish(FinishReason.STOP, Usage(prompt_tokens=3, completion_tokens=2), 0.0, 0.05, 0.0502)
    assert _rated(m) == (0.0, 0.0)
    assert m.registry.get_sample_value("specmask_time_to_first_token_seconds_count") == 1.0
    n = MIN_TOKENS_FOR_RATE + 2
    m.observe_finish(FinishReason.LENGTH, Usage(prompt_tokens=3, completion_tokens=n), 0.0, 0.1, 1.1)
    assert _rated(m) == (1.0, float(n - 1))  # (n - 1) tokens over the 1 s after the first
