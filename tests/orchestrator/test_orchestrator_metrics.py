"""Orchestrator metrics: what the histograms rate and what the counters count."""

from __future__ import annotations

from specmask.gpu_worker.types import FinishReason
from specmask.orchestrator.metrics import MIN_TOKENS_FOR_RATE, OrchestratorMetrics
from specmask.orchestrator.types import Usage


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


def test_outputs_of_requests_no_longer_running_are_not_counted_as_emitted() -> None:
    """A step in flight when its request was cancelled (or finished by a stop string) still
    returns that sequence's output; the engine drops it, and the token counters skip it. The
    step itself (latency, batch size, mask wait) counts whole."""
    from specmask.gpu_worker.types import SessionWait, StepOutput

    m = OrchestratorMetrics()
    kept = StepOutput("kept", [1, 2, 3], drafts_proposed=3, drafts_accepted=2, target_forwards=1, mask_time_s=0.002)
    dropped = StepOutput("gone", [4, 5], None, drafts_proposed=2, drafts_accepted=1, target_forwards=1)
    dropped.session_wait = SessionWait.READY
    m.observe_step(0, 0.01, [kept, dropped], running={"kept"})
    value = m.registry.get_sample_value
    assert value("specmask_generated_tokens_total") == 3.0
    assert value("specmask_target_forwards_total") == 1.0
    assert value("specmask_drafts_proposed_total") == 3.0 and value("specmask_drafts_accepted_total") == 2.0
    assert (value("specmask_session_waits_total", {"outcome": "ready"}) or 0.0) == 0.0
    assert value("specmask_worker_batch_size_sum") == 2.0 and value("specmask_mask_wait_seconds_count") == 1.0
    m.observe_step(0, 0.01, [dropped])  # no running set given: everything counts
    assert value("specmask_generated_tokens_total") == 5.0


def test_acceptance_by_draft_position_is_conditional_on_reaching_it() -> None:
    """Position i is reached when a step proposed >= i drafts and accepted the i - 1 before it:
    a step proposing 4 and accepting 2 reaches 1, 2, 3 and accepts 1, 2; one proposing 3 and
    accepting all reaches and accepts 1..3; one proposing 2 and accepting none reaches only 1."""
    from specmask.gpu_worker.types import StepOutput

    m = OrchestratorMetrics()
    outs = [
        StepOutput("a", [1, 2, 3], drafts_proposed=4, drafts_accepted=2, target_forwards=1),
        StepOutput("b", [1, 2, 3, 4], drafts_proposed=3, drafts_accepted=3, target_forwards=1),
        StepOutput("c", [1], drafts_proposed=2, drafts_accepted=0, target_forwards=1),
        StepOutput("d", [1], drafts_proposed=0, drafts_accepted=0, target_forwards=1),
    ]
    m.observe_step(0, 0.01, outs)
    reached, accepted = m.position_totals()
    assert reached == {1: 3, 2: 2, 3: 2}
    assert accepted == {1: 2, 2: 2, 3: 1}
    value = m.registry.get_sample_value
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert value(per_pos, {"model_name": "specmask", "position": "0"}) == 2.0
    assert value(per_pos, {"model_name": "specmask", "position": "2"}) == 1.0
    assert value("specmask_draft_position_reached_total", {"position": "3"}) == 2.0


def test_vllm_series_carry_the_model_name() -> None:
    """Every vllm:* series carries vLLM's model_name label, set to the served model id (odd
    characters included): routers and KEDA queries select a model's series by it."""
    from specmask.gpu_worker.types import StepOutput

    m = OrchestratorMetrics(model_name="org/Model-7B ü")
    m.observe_step(0, 0.01, [StepOutput("a", [1, 2], drafts_proposed=2, drafts_accepted=1, target_forwards=1)])
    m.observe_finish(FinishReason.LENGTH, Usage(prompt_tokens=3, completion_tokens=2), 0.0, 0.05, 0.5)
    m.observe_load(waiting=2, running=3, slots=4)
    m.observe_queued(0.2)
    m.observe_tokens_after_first(0.3, 3)
    families = [f for f in m.registry.collect() if f.name.startswith("vllm:")]
    assert {f.name for f in families} >= {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:inter_token_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
    }
    for family in families:
        assert family.samples, family.name
        for sample in family.samples:
            assert sample.labels.get("model_name") == "org/Model-7B ü", (family.name, sample.labels)
    value = m.registry.get_sample_value
    model = {"model_name": "org/Model-7B ü"}
    assert value("vllm:num_requests_waiting", model) == 2.0 == value("specmask_queue_depth")
    assert value("vllm:num_requests_running", model) == 3.0
    assert value("vllm:kv_cache_usage_perc", model) == 0.75 == value("specmask_batch_slot_usage")
    assert value("vllm:request_queue_time_seconds_count", model) == 1.0
    assert value("vllm:request_success_total", {**model, "finished_reason": "length"}) == 1.0


def test_load_gauges_at_the_edges() -> None:
    m = OrchestratorMetrics()
    value = m.registry.get_sample_value
    m.observe_load(waiting=0, running=0, slots=0)  # no healthy worker: no room at all
    assert value("vllm:kv_cache_usage_perc", {"model_name": "specmask"}) == 1.0
    m.observe_load(waiting=0, running=9, slots=8)  # clamped: the gauge never reads above full
    assert value("vllm:kv_cache_usage_perc", {"model_name": "specmask"}) == 1.0
    m.observe_load(waiting=5, running=0, slots=8)
    assert value("vllm:kv_cache_usage_perc", {"model_name": "specmask"}) == 0.0


def test_kv_usage_under_a_budget_is_the_reserved_fraction() -> None:
    """With a KV budget both KV gauges read the reserved fraction of it, not the slot usage."""
    from specmask.gpu_worker.kv_budget import KVBudget

    m = OrchestratorMetrics()
    value = m.registry.get_sample_value
    budget = KVBudget(positions=4096, max_model_len=512, slack=16, min_capacity=64)
    reserved = budget.usage([budget.need(6, 30)] * 3 + [budget.need(150, 40)])  # 4 slots x 206 positions
    m.observe_load(waiting=1, running=4, slots=64, kv_usage=reserved)
    assert value("specmask_batch_slot_usage") == 4 / 64
    assert value("specmask_kv_cache_usage_ratio") == 4 * 206 / 4096
    assert value("vllm:kv_cache_usage_perc", {"model_name": "specmask"}) == 4 * 206 / 4096
    m.observe_load(waiting=0, running=2, slots=8)  # no budget: the slot usage
    assert (
        value("specmask_kv_cache_usage_ratio") == 0.25 == value("vllm:kv_cache_usage_perc", {"model_name": "specmask"})
    )


def test_inter_token_latency_spreads_a_burst_over_its_tokens() -> None:
    """A speculative step delivering 4 tokens 0.4 s after the last counts 4 tokens of 0.1 s:
    sum / count is the time per output token, as a dashboard computes it."""
    m = OrchestratorMetrics()
    model = {"model_name": "specmask"}
    m.observe_tokens_after_first(0.4, 4)
    m.observe_tokens_after_first(0.2, 1)
    m.observe_tokens_after_first(0.5, 0)  # no tokens: nothing observed
    value = m.registry.get_sample_value
    assert value("vllm:inter_token_latency_seconds_count", model) == 5.0
    assert abs((value("vllm:inter_token_latency_seconds_sum", model) or 0.0) - 0.6) < 1e-9
    assert value("vllm:inter_token_latency_seconds_bucket", {**model, "le": "0.1"}) == 4.0
