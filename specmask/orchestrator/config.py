"""The orchestrator's one frozen configuration object, built from flags in main.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specmask.gpu_worker.config import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_ITERATION_TOKENS,
    DEFAULT_MAX_K,
    DEFAULT_STEP_PREFILL_TOKENS,
    WorkerConfig,
)
from specmask.mask_service.client.replicas import parse_targets
from specmask.orchestrator import token_admission, validation, verdict_cache
from specmask.orchestrator.api.http.tool_formats import ToolCallParser
from specmask.orchestrator.reasoning import ReasoningParser

# Local runs listen on loopback only (a dev box should not expose an
# unauthenticated API); the images and the Helm chart pass --host 0.0.0.0,
# since the kubelet probes and the Service reach the pod IP.
DEFAULT_HOST = "127.0.0.1"
# Requests validating or waiting for a batch slot, beyond which new requests
# get RESOURCE_EXHAUSTED. Bounded so overload shows up as fast, typed refusals
# the client can back off from, never as an unbounded backlog whose latency
# grows without limit.
DEFAULT_MAX_QUEUE = 256
AUTO_INFLIGHT_PER_CLIENT = -1  # max_inflight_per_client: derived (OrchestratorConfig.inflight_cap_per_client)
# Output budget when a request names none; None = the room the prompt leaves in the context
# (vLLM's and OpenAI's default: a long answer is not cut at an arbitrary length).
DEFAULT_MAX_TOKENS: int | None = None
# Drafts per step when a request names none. k=4 sits near the knee of
# (1 - a^(k+1)) / (1 - a) for acceptance rates 0.6-0.8 (docs/design.md).
DEFAULT_K = 4
# The liveness limit. A worker iteration is bounded by its token budget
# (--max-iteration-tokens): milliseconds on a GPU, about a second for the real model on a
# busy CPU. An iteration running past this limit is not a failure by itself: the engine then
# asks the worker's heartbeat, and takes the worker out only when the heartbeat does not
# answer within the limit (SIGSTOPped, wedged, unreachable) or its progress count has not
# moved for ten limits (hung). It also bounds every other Ray call to a worker.
DEFAULT_STEP_TIMEOUT_S = 30.0
# Loading models (and, on a fresh Ray cluster, starting the actor process).
DEFAULT_WORKER_START_TIMEOUT_S = 600.0
# Per ValidateGrammar call; it covers compiling a large schema.
DEFAULT_MASK_DEADLINE_S = 10.0
DEFAULT_MASK_MAX_RETRIES = 2
# Threads that tokenize prompts and validate grammars off the event loop. A
# validation may wait seconds on a new grammar's compile (compile workers run at
# the lowest priority), so a flood of new schemas must not hold every thread from
# requests whose grammars are cached: admission (--max-queue) bounds them anyway.
DEFAULT_VALIDATION_THREADS = 32
# Seconds in-flight RPCs get to finish on shutdown before being cancelled.
DEFAULT_SHUTDOWN_GRACE_S = 5.0
# Ray restarts a crashed worker actor (process death, OOM) this many times;
# -1 = always, as a Deployment would. The engine probes a lost worker and puts
# it back into placement once it answers again.
DEFAULT_WORKER_MAX_RESTARTS = -1
# With every worker lost while one is being recovered or replaced (a restart loads the model):
# how long queued and new requests wait for it before they fail / are refused with a retry hint.
DEFAULT_WORKER_RECOVERY_WAIT_S = 120.0
# torch threads of each worker process: 0 = every CPU it may run on, when its device is
# the CPU (Ray would give an actor without num_cpus one: it sets OMP_NUM_THREADS=1).
# GPU workers keep their default. See WorkerConfig.torch_threads for the figures.
DEFAULT_WORKER_TORCH_THREADS = 0
# Checked mode: the most generations (1 + resamples) a request may ask for.
DEFAULT_CHECKED_MAX_ATTEMPTS = validation.DEFAULT_CHECKED_MAX_ATTEMPTS
# A JSON Schema no engine enforces exactly, for a request that does not say: checked mode, or a refusal.
DEFAULT_GRAMMAR_FALLBACK = validation.DEFAULT_GRAMMAR_FALLBACK
DEFAULT_MAX_QUEUED_PROMPT_TOKENS = token_admission.DEFAULT_MAX_QUEUED_PROMPT_TOKENS
DEFAULT_MAX_WORKER_PROMPT_TOKENS = token_admission.DEFAULT_MAX_WORKER_PROMPT_TOKENS
DEFAULT_GRAMMAR_VERDICT_CACHE_ENTRIES = verdict_cache.DEFAULT_MAX_ENTRIES
DEFAULT_GRAMMAR_VERDICT_TTL_S = verdict_cache.DEFAULT_TTL_S


@dataclass(frozen=True)
class OrchestratorConfig:
    target_dir: str  # HF dir of the target model (its tokenizer is the API's tokenizer)
    mask_service_addresses: tuple[str, ...]  # every replica; workers spread sessions over them
    draft_dir: str | None = None
    host: str = DEFAULT_HOST
    port: int = 50051  # 0 = pick a free port (tests)
    ray_address: str = "local"  # "local" = start (or join) an in-process Ray; else a Ray address
    num_workers: int = 1
    metrics_port: int | None = None  # Prometheus endpoint; None = off, 0 = pick a free port
    http_port: int | None = None  # OpenAI-compatible HTTP API; None = off, 0 = pick a free port
    served_model_name: str | None = None  # the model id of the HTTP API; None = the target dir's name
    max_queue: int = DEFAULT_MAX_QUEUE
    max_batch: int = DEFAULT_MAX_BATCH  # per worker
    max_k: int = DEFAULT_MAX_K
    default_k: int = DEFAULT_K
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS  # None = the rest of the context
    max_model_len: int | None = None  # None = the target model's
    dtype: str = "auto"  # gpu_worker.config.DTYPES: auto = the checkpoint's on CUDA, float32 on a CPU
    device: str = "auto"
    worker_num_gpus: float | None = None  # None = 1 when CUDA is visible to this process, else 0
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    worker_start_timeout_s: float = DEFAULT_WORKER_START_TIMEOUT_S
    worker_max_restarts: int = DEFAULT_WORKER_MAX_RESTARTS
    worker_recovery_wait_s: float = DEFAULT_WORKER_RECOVERY_WAIT_S
    worker_torch_threads: int = DEFAULT_WORKER_TORCH_THREADS
    # Trailing prompt tokens a new sequence's first step feeds (gpu_worker.config says why).
    step_prefill_tokens: int = DEFAULT_STEP_PREFILL_TOKENS
    # Target tokens per worker iteration, prefill chunks and decode rows together (gpu_worker.config).
    max_iteration_tokens: int = DEFAULT_MAX_ITERATION_TOKENS
    # Prompt tokens waiting for a worker, and placed on one worker (orchestrator.token_admission); 0 = off.
    max_queued_prompt_tokens: int = DEFAULT_MAX_QUEUED_PROMPT_TOKENS
    max_worker_prompt_tokens: int = DEFAULT_MAX_WORKER_PROMPT_TOKENS
    # Each worker's KV budget (gpu_worker.kv_budget): bytes, or vLLM's fraction of its CUDA
    # device's memory; None for both = unbounded pools. Requests are placed only where they fit.
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    mask_deadline_s: float = DEFAULT_MASK_DEADLINE_S
    mask_max_retries: int = DEFAULT_MASK_MAX_RETRIES
    validation_threads: int = DEFAULT_VALIDATION_THREADS
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    checked_max_attempts: int = DEFAULT_CHECKED_MAX_ATTEMPTS  # checked mode: cap on a request's max_attempts
    grammar_fallback: validation.GrammarFallback = DEFAULT_GRAMMAR_FALLBACK  # --grammar-fallback checked|refuse
    # JSON Schema chats get the schema in a system message by default (orchestrator.chat); off: only on request.
    schema_instruction: bool = False
    # --reasoning-parser: the model thinks in this format before its answer (orchestrator/reasoning.py)
    reasoning_parser: ReasoningParser | None = None
    # --tool-call-parser: the format tool calls are written in (api/http/tool_formats.py); auto: the template's
    tool_call_parser: ToolCallParser = ToolCallParser.AUTO
    # Requests one end client (orchestrator.client_identity) may have in flight; 0 = no cap,
    # AUTO_INFLIGHT_PER_CLIENT = every batch slot plus half the admission queue (inflight_cap_per_client).
    max_inflight_per_client: int = AUTO_INFLIGHT_PER_CLIENT
    # Keys the public APIs require (orchestrator.auth_keys); () = open. Not in repr: never logged.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    cors_origins: tuple[str, ...] = ()  # origins browsers may call the HTTP API from; () = no CORS
    # The mask tier's verdicts on grammars, kept this long and this many (orchestrator.verdict_cache):
    # a grammar judged recently costs a request no ValidateGrammar round trip. 0 entries = off.
    grammar_verdict_cache_entries: int = DEFAULT_GRAMMAR_VERDICT_CACHE_ENTRIES
    grammar_verdict_ttl_s: float = DEFAULT_GRAMMAR_VERDICT_TTL_S
    # Logging of the GPU-worker processes (Ray actors): INFO keeps their [request_id=...] lines.
    worker_log_level: str | None = "INFO"
    log_format: str = "text"

    def __post_init__(self) -> None:
        if not self.mask_service_addresses:
            raise ValueError("at least one mask-service address is required")
        parse_targets(self.mask_service_addresses)  # host:port or dns:///name:port, else ValueError
        for name in (
            "num_workers",
            "max_queue",
            "max_batch",
            "validation_threads",
            "checked_max_attempts",
            "step_prefill_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(
                f"default_max_tokens must be >= 1 (None = the rest of the context), got {self.default_max_tokens}"
            )
        if self.max_iteration_tokens < 0:
            raise ValueError(f"max_iteration_tokens must be >= 0 (0 = by device), got {self.max_iteration_tokens}")
        self.prompt_token_bounds()  # negative bounds raise ValueError
        if self.reasoning_parser is not None and not isinstance(self.reasoning_parser, ReasoningParser):
            raise ValueError(f"reasoning_parser must be a ReasoningParser or None, got {self.reasoning_parser!r}")
        if not isinstance(self.tool_call_parser, ToolCallParser):
            raise ValueError(f"tool_call_parser must be a ToolCallParser, got {self.tool_call_parser!r}")
        if not isinstance(self.grammar_fallback, validation.GrammarFallback):
            raise ValueError(f"grammar_fallback must be a GrammarFallback, got {self.grammar_fallback!r}")
        if self.grammar_verdict_cache_entries < 0:
            raise ValueError(
                f"grammar_verdict_cache_entries must be >= 0 (0 = off), got {self.grammar_verdict_cache_entries}"
            )
        if self.grammar_verdict_ttl_s <= 0:
            raise ValueError(f"grammar_verdict_ttl_s must be > 0, got {self.grammar_verdict_ttl_s}")
        if self.worker_torch_threads < 0:
            raise ValueError(f"worker_torch_threads must be >= 0 (0 = every CPU), got {self.worker_torch_threads}")
        if self.worker_max_restarts < -1:
            raise ValueError(f"worker_max_restarts must be >= -1, got {self.worker_max_restarts}")
        if not self.worker_recovery_wait_s >= 0:
            raise ValueError(f"worker_recovery_wait_s must be >= 0, got {self.worker_recovery_wait_s}")
        if self.max_inflight_per_client < AUTO_INFLIGHT_PER_CLIENT:
            raise ValueError(
                f"max_inflight_per_client must be >= 0 (0 = no cap) or -1 (auto), got {self.max_inflight_per_client}"
            )
        if self.kv_cache_bytes is not None or self.gpu_memory_utilization is not None:
            self.worker_config()  # the budget's bounds: WorkerConfig raises ValueError
        if not 0 <= self.default_k <= self.max_k:
            raise ValueError(f"need 0 <= default_k <= max_k, got {self.default_k}, {self.max_k}")

    @property
    def model_name(self) -> str:
        """The served model id: what /v1/models lists and the metrics' ``model_name`` label."""
        return self.served_model_name or Path(self.target_dir).name  # as the HTTP API names it

    @property
    def inflight_cap_per_client(self) -> int:
        """The per-client in-flight cap in force (0 = none). By default a client may fill
        every batch slot (fair placement shares them while others wait) and half the
        admission queue, so one client's flood always leaves room for another's requests."""
        if self.max_inflight_per_client != AUTO_INFLIGHT_PER_CLIENT:
            return self.max_inflight_per_client
        return self.max_batch * self.num_workers + max(1, self.max_queue // 2)

    def prompt_token_bounds(self) -> token_admission.PromptTokenBounds:
        return token_admission.PromptTokenBounds(
            max_queued_prompt_tokens=self.max_queued_prompt_tokens,
            max_worker_prompt_tokens=self.max_worker_prompt_tokens,
        )

    def worker_config(self) -> WorkerConfig:
        """What every GPU worker gets: all mask-service replicas, so its router can fail over."""
        return WorkerConfig(
            target_dir=self.target_dir,
            draft_dir=self.draft_dir,
            dtype=self.dtype,
            device=self.device,
            mask_service_addresses=self.mask_service_addresses,
            max_batch=self.max_batch,
            max_k=self.max_k,
            max_model_len=self.max_model_len,
            mask_deadline_s=self.mask_deadline_s,
            torch_threads=self.worker_torch_threads,
            step_prefill_tokens=self.step_prefill_tokens,
            max_iteration_tokens=self.max_iteration_tokens,
            kv_cache_bytes=self.kv_cache_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            log_level=self.worker_log_level,
            log_format=self.log_format,
        )
