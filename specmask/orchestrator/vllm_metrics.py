"""The ``vllm:*`` series: vLLM's names for the orchestrator's measures.

Autoscalers, routers and dashboards built for vLLM read these names (KEDA recipes, the
production-stack router, the llm-d endpoint picker, vLLM's Grafana boards), so they come
with vLLM's types, buckets and ``model_name`` label (the served model id). What each means
here, where SpecMask differs from vLLM, is in docs/operations.md.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specmask.gpu_worker.types import FinishReason
from specmask.orchestrator.draft_positions import PositionCounter

# vLLM's buckets for its names (vllm/v1/metrics/loggers.py), so a board's le="..." matches.
_VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
_VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_VLLM_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
# The label vLLM puts on every series: the served model id.
MODEL_NAME_LABEL = "model_name"


class VllmMetrics:
    """vLLM's series, each bound to one server's ``model_name`` once; the per-position and
    per-reason ones add their own label."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r = registry
        self.model_name = model_name
        labels = [MODEL_NAME_LABEL]
        model = {MODEL_NAME_LABEL: model_name}
        self.running = Gauge(
            "vllm:num_requests_running",
            "Requests placed on a worker (in a batch, or sent with its next iteration)",
            labels,
            registry=r,
        ).labels(**model)
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Requests validating or waiting for a batch slot (specmask_queue_depth)",
            labels,
            registry=r,
        ).labels(**model)
        # With a KV budget: the fraction of it the placed requests reserve (each its prompt and
        # max_tokens, gpu_worker.kv_budget), which reads near 1 when a new request would wait for
        # memory. Without one, each running sequence holds one row of its worker's KV slot pool,
        # so it is the batch-slot fraction: not a byte figure (a row grows with its sequence).
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 1 = full: the fraction of the workers' KV budgets reserved (without a budget, "
            "of their KV pool rows, the batch slots, in use)",
            labels,
            registry=r,
        ).labels(**model)
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Arrival to first token",
            labels,
            buckets=_VLLM_TTFT_BUCKETS,
            registry=r,
        ).labels(**model)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time per output token after the first: a step delivering n tokens after a gap of t counts n tokens of t/n",
            labels,
            buckets=_VLLM_ITL_BUCKETS,
            registry=r,
        ).labels(**model)
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to final token",
            labels,
            buckets=_VLLM_REQUEST_BUCKETS,
            registry=r,
        ).labels(**model)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Admission to being sent to a worker (specmask_request_queue_seconds)",
            labels,
            buckets=_VLLM_REQUEST_BUCKETS,
            registry=r,
        ).labels(**model)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests", labels, registry=r
        ).labels(**model)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Completion tokens emitted", labels, registry=r
        ).labels(**model)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason", [*labels, "finished_reason"], registry=r
        )
        self.spec_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", labels, registry=r
        ).labels(**model)
        self.spec_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels, registry=r
        ).labels(**model)
        # Accepted tokens per draft position (0-based).
        self.spec_accepted_per_pos = PositionCounter(
            Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position",
                [*labels, "position"],
                registry=r,
            ),
            first=0,
            labels=model,
        )

    def observe_output(self, tokens: int, proposed: int, accepted: int) -> None:
        """One sequence's step output, delivered to its request: ``tokens`` emitted, ``proposed``
        drafts of which the first ``accepted`` were kept."""
        self.generation_tokens.inc(tokens)
        self.spec_draft_tokens.inc(proposed)
        self.spec_accepted_tokens.inc(accepted)
        self.spec_accepted_per_pos.inc_first(accepted)

    def observe_load(self, *, waiting: int, running: int, kv_usage: float) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv_cache_usage.set(kv_usage)

    def observe_tokens_after_first(self, gap_s: float, n_tokens: int) -> None:
        """``n_tokens`` delivered ``gap_s`` after the request's previous ones: each counts as
        ``gap_s / n_tokens`` (OrchestratorMetrics.observe_tokens_after_first says why)."""
        if n_tokens <= 0 or gap_s < 0:
            return
        per_token = gap_s / n_tokens
        for _ in range(n_tokens):
            self.inter_token_latency.observe(per_token)

    def observe_finish(self, reason: FinishReason, prompt_tokens: int, e2e_s: float, ttft_s: float | None) -> None:
        self.request_success.labels(model_name=self.model_name, finished_reason=reason.value).inc()
        self.e2e_latency.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
