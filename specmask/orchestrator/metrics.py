"""Prometheus metrics of the orchestrator.

Each server owns a ``CollectorRegistry`` (not the process-global one), so two
servers in one process (tests) do not collide, and the endpoint shows only
this server's series.

Beside SpecMask's own ``specmask_*`` series, the ``vllm:*`` names autoscalers,
routers and dashboards built for vLLM read (KEDA recipes, the production-stack
router, the llm-d endpoint picker, vLLM's Grafana boards), with vLLM's types,
buckets and ``model_name`` label (the served model id). What each means here,
where SpecMask differs from vLLM, is in docs/operations.md.
"""

from __future__ import annotations

from collections.abc import Container
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specmask.gpu_worker.types import FinishReason, StepOutput
from specmask.orchestrator.types import Usage

# Latency buckets spanning one GPU step to a multi-minute CPU request.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TPS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
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
        self._vllm_series(r)
        # Acceptance by draft position: position i (1-based) is *reached* in a step that proposed at
        # least i drafts and accepted the i - 1 before it; acceptance at i = accepted / reached (the
        # conditional rate, what a longer draft must beat to pay off).
        self.draft_position_reached = Counter(
            "specmask_draft_position_reached",
            "Draft positions verified after every earlier one",
            ["position"],
            registry=r,
        )
        self.draft_position_accepted = Counter(
            "specmask_draft_position_accepted", "Draft positions accepted", ["position"], registry=r
        )
        # id(a per-position counter) -> its children by position, made as positions are first seen.
        self._children: dict[int, list[Counter]] = {}
        self._http_server: WSGIServer | None = None

    def _vllm_series(self, r: CollectorRegistry) -> None:
        """vLLM's names for the same measures. Each is bound to this server's ``model_name``
        once; the per-position and per-reason ones add their own label."""
        labels = [MODEL_NAME_LABEL]
        model = {MODEL_NAME_LABEL: self.model_name}
        self.vllm_running = Gauge(
            "vllm:num_requests_running",
            "Requests placed on a worker (in a batch, or sent with its next iteration)",
            labels,
            registry=r,
        ).labels(**model)
        self.vllm_waiting = Gauge(
            "vllm:num_requests_waiting",
            "Requests validating or waiting for a batch slot (specmask_queue_depth)",
            labels,
            registry=r,
        ).labels(**model)
        # With a KV budget: the fraction of it the placed requests reserve (each its prompt and
        # max_tokens, gpu_worker.kv_budget), which reads near 1 when a new request would wait for
        # memory. Without one, each running sequence holds one row of its worker's KV slot pool,
        # so it is the batch-slot fraction: not a byte figure (a row grows with its sequence).
        self.vllm_kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 1 = full: the fraction of the workers' KV budgets reserved (without a budget, "
            "of their KV pool rows, the batch slots, in use)",
            labels,
            registry=r,
        ).labels(**model)
        self.vllm_time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Arrival to first token",
            labels,
            buckets=_VLLM_TTFT_BUCKETS,
            registry=r,
        ).labels(**model)
        self.vllm_inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time per output token after the first: a step delivering n tokens after a gap of t counts n tokens of t/n",
            labels,
            buckets=_VLLM_ITL_BUCKETS,
            registry=r,
        ).labels(**model)
        self.vllm_e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to final token",
            labels,
            buckets=_VLLM_REQUEST_BUCKETS,
            registry=r,
        ).labels(**model)
        self.vllm_queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Admission to being sent to a worker (specmask_request_queue_seconds)",
            labels,
            buckets=_VLLM_REQUEST_BUCKETS,
            registry=r,
        ).labels(**model)
        self.vllm_prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests", labels, registry=r
        ).labels(**model)
        self.vllm_generation_tokens = Counter(
            "vllm:generation_tokens", "Completion tokens emitted", labels, registry=r
        ).labels(**model)
        self.vllm_request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason", [*labels, "finished_reason"], registry=r
        )
        self.vllm_spec_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", labels, registry=r
        ).labels(**model)
        self.vllm_spec_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels, registry=r
        ).labels(**model)
        # Accepted tokens per draft position (0-based).
        self.vllm_spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position",
            [*labels, "position"],
            registry=r,
        )

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
            self.vllm_generation_tokens.inc(len(o.new_token_ids))
            self.vllm_spec_draft_tokens.inc(o.drafts_proposed)
            self.vllm_spec_accepted_tokens.inc(o.drafts_accepted)
            self._observe_positions(o.drafts_proposed, o.drafts_accepted)
            if o.session_wait is not None:
                self.session_waits.labels(outcome=o.session_wait.value).inc()
                self.steps_sat_out.inc(o.steps_sat_out)

    def observe_load(self, *, waiting: int, running: int, slots: int, kv_usage: float | None = None) -> None:
        """The engine's load now: requests validating or queued, requests placed on a worker,
        the batch slots of the healthy workers, and the fraction of their KV budgets reserved
        (None: they have none)."""
        self.queue_depth.set(waiting)
        self.vllm_waiting.set(waiting)
        self.vllm_running.set(running)
        usage = min(1.0, running / slots) if slots > 0 else 1.0  # no healthy worker: no room at all
        self.slot_usage.set(usage)
        kv = usage if kv_usage is None else min(1.0, kv_usage)
        self.kv_usage.set(kv)
        self.vllm_kv_cache_usage.set(kv)

    def observe_queued(self, seconds: float) -> None:
        """Admission to being sent to a worker, once per request."""
        self.queue_time.observe(seconds)
        self.vllm_queue_time.observe(seconds)

    def observe_tokens_after_first(self, gap_s: float, n_tokens: int) -> None:
        """``n_tokens`` reached a request's client ``gap_s`` after its previous tokens. A step
        delivers up to k + 1 tokens at once; each counts as ``gap_s / n_tokens``, so the sum over
        the count is the time per output token, as vLLM's inter-token latency is without
        speculation (one token a step)."""
        if n_tokens <= 0 or gap_s < 0:
            return
        per_token = gap_s / n_tokens
        for _ in range(n_tokens):
            self.vllm_inter_token_latency.observe(per_token)

    def _observe_positions(self, proposed: int, accepted: int) -> None:
        for reached in self._position_children(self.draft_position_reached, min(accepted + 1, proposed)):
            reached.inc()
        for accepted_at in self._position_children(self.draft_position_accepted, accepted):
            accepted_at.inc()
        for accepted_at in self._position_children(
            self.vllm_spec_accepted_per_pos, accepted, first=0, labels={MODEL_NAME_LABEL: self.model_name}
        ):
            accepted_at.inc()

    def _position_children(
        self, counter: Counter, n: int, *, first: int = 1, labels: dict[str, str] | None = None
    ) -> list[Counter]:
        """The children of ``counter`` for its first ``n`` positions (labels ``first``.., plus
        ``labels``), made once each: observe_step would otherwise look labels up for every draft
        of every output."""
        children = self._children.setdefault(id(counter), [])
        while len(children) < n:
            children.append(counter.labels(**(labels or {}), position=str(len(children) + first)))
        return children[:n]

    def position_totals(self) -> tuple[dict[int, int], dict[int, int]]:
        """(reached, accepted) per draft position so far, for benchmarks."""
        out: tuple[dict[int, int], dict[int, int]] = ({}, {})
        for counts, counter in zip(out, (self.draft_position_reached, self.draft_position_accepted)):
            for metric in counter.collect():
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        counts[int(sample.labels["position"])] = int(sample.value)
        return out

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
        self.vllm_request_success.labels(model_name=self.model_name, finished_reason=reason.value).inc()
        self.vllm_e2e_latency.observe(finish - arrival)
        self.vllm_prompt_tokens.inc(usage.prompt_tokens)
        if first_token is not None:
            self.time_to_first_token.observe(first_token - arrival)
            self.vllm_time_to_first_token.observe(first_token - arrival)
            # Tokens arrive in bursts of up to k+1 per step, so over a request of a few
            # tokens (finish - first_token) may span no step at all: 2 tokens of one burst
            # read as thousands of tokens a second. Shorter requests are not rated.
            if finish > first_token and usage.completion_tokens >= MIN_TOKENS_FOR_RATE:
                self.request_tokens_per_second.observe((usage.completion_tokens - 1) / (finish - first_token))
