"""Prometheus metrics of the orchestrator.

Each server owns a ``CollectorRegistry`` (not the process-global one), so two
servers in one process (tests) do not collide, and the endpoint shows only
this server's series.

Beside SpecMask's own ``specmask_*`` series: the ``vllm:*`` names autoscalers, routers
and dashboards built for vLLM read (orchestrator.vllm_metrics), and acceptance by draft
position (orchestrator.draft_positions). They are registered in that order, after SpecMask's
own, which is the order /metrics lists them in.
"""

from __future__ import annotations

from collections.abc import Container
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specmask.gpu_worker.types import FinishReason, StepOutput
from specmask.orchestrator.draft_positions import DraftPositionMetrics
from specmask.orchestrator.types import Usage
from specmask.orchestrator.vllm_metrics import VllmMetrics

# Latency buckets spanning one GPU step to a multi-minute CPU request.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TPS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
# One step emits at most k+1 tokens (k <= 16 anywhere in the stack): a request with
# more tokens than one step can carry spans at least one step after its first token.
MIN_TOKENS_FOR_RATE = 18


class OrchestratorMetrics:
    """The counters, gauges and histograms the engine and servicer update."""

    def __init__(self, registry: CollectorRegistry | None = None, *, model_name: str = "specmask") -> None:
        """``model_name``: the served model id (the HTTP API's), the ``model_name`` label of the
        ``vllm:*`` series."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        self.requests = Counter(
            "specmask_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "specmask_requests_rejected", "Requests refused before generation, by status code", ["code"], registry=r
        )
        self.http_requests = Counter(
            "specmask_http_requests",
            "HTTP requests by route pattern and final status (4xx and 5xx included)",
            ["route", "status"],
            registry=r,
        )
        self.http_unknown_fields = Counter(
            "specmask_http_unknown_fields",
            "HTTP request fields the server does not know and ignored (orchestrator.api.http.lenient)",
            ["field"],
            registry=r,
        )
        self.request_latency = Histogram(
            "specmask_request_latency_seconds", "Arrival to final token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.time_to_first_token = Histogram(
            "specmask_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        # Where time to first token goes, by phase (the rest of it is the first step: the
        # prompt's forward, and any wait for the grammar's mask session, session_waits below).
        self.admission = Histogram(
            "specmask_request_admission_seconds",
            "Arrival to admission: request validation and the grammar check (a new grammar's compile included)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "specmask_request_queue_seconds",
            "Admission to being sent to a worker: waiting for a batch slot, then for the worker's next iteration",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_tokens_per_second = Histogram(
            "specmask_request_tokens_per_second",
            "Completion tokens / (finish - first token)",
            buckets=_TPS_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("specmask_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("specmask_generated_tokens", "Completion tokens emitted", registry=r)
        self.target_forwards = Counter(
            "specmask_target_forwards", "Per-sequence target forward participations", registry=r
        )
        self.drafts_proposed = Counter("specmask_drafts_proposed", "Draft tokens proposed", registry=r)
        self.drafts_accepted = Counter("specmask_drafts_accepted", "Draft tokens accepted", registry=r)
        # No lifetime-ratio gauges: a ratio since start hides what changed an hour ago and
        # cannot be summed over replicas. Ratios come from the counters, over any window:
        #   acceptance        = rate(specmask_drafts_accepted_total[5m]) / rate(specmask_drafts_proposed_total[5m])
        #   tokens per forward = rate(specmask_generated_tokens_total[5m]) / rate(specmask_target_forwards_total[5m])
        self.mask_wait = Histogram(
            "specmask_mask_wait_seconds",
            "Per worker step: time waiting on the mask service",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_latency = Histogram(
            "specmask_worker_step_seconds",
            "One worker iteration as seen by the orchestrator: its removes and adds, the step, the Ray round trip",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # The worker's add() does not wait for a grammar sequence's mask session: these say
        # what the open's latency cost (gpu_worker.types.SessionWait). Many sat_out, or a
        # growing steps_sat_out rate, means the mask tier answers opens slower than a step.
        self.session_waits = Counter(
            "specmask_session_waits",
            "Grammar sequences by how their mask-session open met their first step: ready, joined_late "
            "(joined a step in flight without drafts), sat_out (sat out whole steps first)",
            ["outcome"],
            registry=r,
        )
        self.steps_sat_out = Counter(
            "specmask_steps_sat_out", "Steps grammar sequences sat out waiting for their mask session", registry=r
        )
        self.batch_size = Histogram(
            "specmask_worker_batch_size",
            "Sequences per worker step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.queue_depth = Gauge("specmask_queue_depth", "Requests validating or waiting for a batch slot", registry=r)
        self.running = Gauge("specmask_running_requests", "Requests placed on a worker", ["worker"], registry=r)
        self.healthy_workers = Gauge("specmask_healthy_workers", "Workers accepting requests", registry=r)
        self.worker_failures = Counter(
            "specmask_worker_failures", "Workers taken out of placement (died or timed out)", ["worker"], registry=r
        )
        self.grammar_violations = Counter(
            "specmask_grammar_violations",
            "Outputs that broke their grammar and were failed (GRAMMAR_VIOLATION), by where they were caught: "
            "device (the sampler's mask check) or output_check (the end-of-request check)",
            ["stage"],
            registry=r,
        )
        self.grammar_requests = Counter(
            "specmask_grammar_requests",
            "Grammar requests finished, by enforcement: exact (masked by the caller's grammar) or checked "
            "(masked by a relaxation, checked at the end)",
            ["enforcement"],
            registry=r,
        )
        self.checked_attempts = Counter(
            "specmask_checked_attempts",
            "Checked-mode generations by outcome: passed (returned), resampled (failed the end check, regenerated), "
            "exhausted (failed the end check with no attempts left: GRAMMAR_VIOLATION)",
            ["outcome"],
            registry=r,
        )
        self.requeued = Counter(
            "specmask_requeued_requests",
            "Requests a lost worker held before they generated anything, queued again instead of failed",
            registry=r,
        )
        self.worker_recoveries = Counter(
            "specmask_worker_recoveries", "Lost workers that answered again and were put back", ["worker"], registry=r
        )
        self.worker_restarts = Counter(
            "specmask_worker_restarts",
            "Replacement actors the orchestrator started for lost workers (killed, dead or stopped)",
            ["worker"],
            registry=r,
        )
        self.slot_usage = Gauge(
            "specmask_batch_slot_usage",
            "Fraction of the healthy workers' batch slots held by placed requests (1 when none is healthy)",
            registry=r,
        )
        self.kv_usage = Gauge(
            "specmask_kv_cache_usage_ratio",
            "Fraction of the healthy workers' KV budgets the placed requests reserve (gpu_worker.kv_budget); "
            "without a budget, specmask_batch_slot_usage",
            registry=r,
        )
        self.vllm = VllmMetrics(r, model_name)
        self.draft_positions = DraftPositionMetrics(r)
        self._http_server: WSGIServer | None = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose /metrics over HTTP (a daemon thread); returns the bound port (``port=0`` picks one)."""
        self._http_server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http_server.server_port)

    def close(self) -> None:
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None

    def observe_step(
        self, worker: int, step_s: float, outputs: list[StepOutput], running: Container[str] | None = None
    ) -> None:
        """One worker step. ``running``: the sequences whose outputs are delivered; the token and
        draft counters skip the rest (finished or cancelled here while the step was queued)."""
        self.step_latency.labels(worker=str(worker)).observe(step_s)
        self.batch_size.observe(len(outputs))
        # The worker reports the batch's mask wait on every sequence's output.
        if outputs:
            self.mask_wait.observe(max(o.mask_time_s for o in outputs))
        for o in outputs:
            if running is not None and o.seq_id not in running:
                continue
            self.generated_tokens.inc(len(o.new_token_ids))
            self.target_forwards.inc(o.target_forwards)
            self.drafts_proposed.inc(o.drafts_proposed)
            self.drafts_accepted.inc(o.drafts_accepted)
            self.vllm.observe_output(len(o.new_token_ids), o.drafts_proposed, o.drafts_accepted)
            self.draft_positions.observe(o.drafts_proposed, o.drafts_accepted)
            if o.session_wait is not None:
                self.session_waits.labels(outcome=o.session_wait.value).inc()
                self.steps_sat_out.inc(o.steps_sat_out)

    def observe_load(self, *, waiting: int, running: int, slots: int, kv_usage: float | None = None) -> None:
        """The engine's load now: requests validating or queued, requests placed on a worker,
        the batch slots of the healthy workers, and the fraction of their KV budgets reserved
        (None: they have none)."""
        self.queue_depth.set(waiting)
        usage = min(1.0, running / slots) if slots > 0 else 1.0  # no healthy worker: no room at all
        self.slot_usage.set(usage)
        kv = usage if kv_usage is None else min(1.0, kv_usage)
        self.kv_usage.set(kv)
        self.vllm.observe_load(waiting=waiting, running=running, kv_usage=kv)

    def observe_queued(self, seconds: float) -> None:
        """Admission to being sent to a worker, once per request."""
        self.queue_time.observe(seconds)
        self.vllm.queue_time.observe(seconds)

    def observe_tokens_after_first(self, gap_s: float, n_tokens: int) -> None:
        """``n_tokens`` reached a request's client ``gap_s`` after its previous tokens. A step
        delivers up to k + 1 tokens at once; each counts as ``gap_s / n_tokens``, so the sum over
        the count is the time per output token, as vLLM's inter-token latency is without
        speculation (one token a step)."""
        self.vllm.observe_tokens_after_first(gap_s, n_tokens)

    def position_totals(self) -> tuple[dict[int, int], dict[int, int]]:
        """(reached, accepted) per draft position so far, for benchmarks."""
        return self.draft_positions.totals()

    def step_totals(self) -> tuple[int, float, int]:
        """(steps, seconds in steps, sequence-steps) summed over workers, for benchmarks."""
        steps, seconds = 0, 0.0
        for metric in self.step_latency.collect():
            for sample in metric.samples:
                if sample.name.endswith("_count"):
                    steps += int(sample.value)
                elif sample.name.endswith("_sum"):
                    seconds += sample.value
        sequences = self.registry.get_sample_value("specmask_worker_batch_size_sum") or 0.0
        return steps, seconds, int(sequences)

    def observe_finish(
        self,
        reason: FinishReason,
        usage: Usage,
        arrival: float,
        first_token: float | None,
        finish: float,
    ) -> None:
        self.requests.labels(finish_reason=reason.value).inc()
        self.request_latency.observe(finish - arrival)
        self.prompt_tokens.inc(usage.prompt_tokens)
        ttft = None if first_token is None else first_token - arrival
        self.vllm.observe_finish(reason, usage.prompt_tokens, finish - arrival, ttft)
        if first_token is not None:
            self.time_to_first_token.observe(first_token - arrival)
            # Tokens arrive in bursts of up to k+1 per step, so over a request of a few
            # tokens (finish - first_token) may span no step at all: 2 tokens of one burst
            # read as thousands of tokens a second. Shorter requests are not rated.
            if finish > first_token and usage.completion_tokens >= MIN_TOKENS_FOR_RATE:
                self.request_tokens_per_second.observe((usage.completion_tokens - 1) / (finish - first_token))
