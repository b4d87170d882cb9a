"""The orchestrator's one frozen configuration object, built from flags in main.py."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from specmask.common.config_flags import flag
from specmask.common.log_format import LOG_FORMATS
from specmask.common.startup import PORT_OFF, port_flag
from specmask.common.tracing import OTLP_ENDPOINT_HELP
from specmask.gpu_worker.config import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_ITERATION_TOKENS,
    DEFAULT_MAX_K,
    DEFAULT_STEP_PREFILL_TOKENS,
    DTYPES,
    WorkerConfig,
)
from specmask.mask_service.client.replicas import parse_targets
from specmask.orchestrator import autoscale, token_admission, validation, verdict_cache
from specmask.orchestrator.api.http.tool_formats import ToolCallParser
from specmask.orchestrator.reasoning import ReasoningParser

# Local runs listen on loopback only (a dev box should not expose an
# unauthenticated API); the images and the Helm chart pass --host 0.0.0.0,
# since the kubelet probes and the Service reach the pod IP.
DEFAULT_HOST = "127.0.0.1"
# A pooled worker's name part (orchestrator.worker_pool.worker_name).
_POOL_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?")
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
# Worker autoscaling (orchestrator.autoscale): the oldest waiting request's wait that, held for
# the sustain time, adds a worker; the time the load must fit one worker fewer before one goes.
DEFAULT_SCALE_UP_QUEUE_WAIT_S = 2.0
DEFAULT_SCALE_UP_AFTER_S = 10.0
DEFAULT_SCALE_DOWN_IDLE_S = 120.0
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
# The HTTP API is off in a config built in code (tests, benches ask for it) but on by default on
# the command line, at vLLM's port, so `specmask orchestrator` serves the OpenAI SDK as it comes.
CLI_HTTP_PORT = 8000


def mask_addresses(text: str) -> tuple[str, ...]:
    """``--mask-service a:1, b:2`` -> ("a:1", "b:2"): blanks around and between commas dropped."""
    return tuple(a.strip() for a in text.split(",") if a.strip())


@dataclass(frozen=True)
class _OrchestratorFields:
    """OrchestratorConfig's fields, each with its command-line flag (common.config_flags), in the
    order `specmask orchestrator --help` lists them. Kept apart from the rules that join them and
    the settings derived from them (``OrchestratorConfig``), so each reads on its own: build
    ``OrchestratorConfig``, which checks every value; this class checks none."""

    # HF dir of the target model (its tokenizer is the API's tokenizer)
    target_dir: str = field(
        metadata=flag(
            "target model: an HF dir (with tokenizer) or a registered name (`specmask models list`; fetched once)",
            name="--target",
            metavar="DIR|NAME",
        )
    )
    # every replica; workers spread sessions over them
    mask_service_addresses: tuple[str, ...] = field(
        metadata=flag(
            "mask-service replica addresses (host:port), comma-separated; all go to every worker",
            name="--mask-service",
            metavar="ADDR[,ADDR...]",
            convert=mask_addresses,
        )
    )
    draft_dir: str | None = field(
        default=None,
        metadata=flag("draft model dir or registered name (omit: no draft model)", name="--draft", metavar="DIR|NAME"),
    )
    host: str = field(
        default=DEFAULT_HOST,
        metadata=flag(
            "interface for the API and metrics: 127.0.0.1 (local default) keeps it off the network; "
            "containers pass 0.0.0.0 (or :: for IPv6), as the images and the Helm chart do"
        ),
    )
    port: int = field(default=50051, metadata=flag("gRPC API port (0 = pick a free one)"))
    # "local" = start (or join) an in-process Ray; else a Ray address
    ray_address: str = field(default="local", metadata=flag("Ray cluster address, or 'local' to start one in-process"))
    # A Ray head started with the release (KubeRay) can take minutes to accept clients on a busy
    # node; the default sits well inside the chart's startup probe, so a slow head is waited for
    # rather than answered with restarts, and a wrong address still ends the container.
    ray_join_timeout_s: float = field(
        default=300.0,
        metadata=flag(
            "how long to keep trying to join a Ray cluster (--ray-address) that refuses or times out "
            "the connection at start-up, with back-off, before exiting (0 = one try)"
        ),
    )
    num_workers: int = field(default=1, metadata=flag("GPU worker actors"))
    # Prometheus endpoint; None = off, 0 = pick a free port
    metrics_port: int | None = field(
        default=None,
        metadata=flag(
            "Prometheus /metrics port (-1 = off, 0 = pick a free one)", convert=port_flag, cli_default=PORT_OFF
        ),
    )
    # OpenAI-compatible HTTP API; None = off, 0 = pick a free port
    http_port: int | None = field(
        default=None,
        metadata=flag(
            "OpenAI-compatible HTTP API port (0 = pick a free one, -1 = off)",
            convert=port_flag,
            cli_default=CLI_HTTP_PORT,
        ),
    )
    # the model id of the HTTP API; None = the target dir's name
    served_model_name: str | None = field(
        default=None, metadata=flag("model id of the HTTP API (default: the --target dir's name)")
    )
    max_queue: int = field(
        default=DEFAULT_MAX_QUEUE, metadata=flag("requests validating or waiting before RESOURCE_EXHAUSTED")
    )
    max_batch: int = field(  # per worker
        default=DEFAULT_MAX_BATCH,
        metadata=flag("active sequences per worker (vLLM's --max-num-seqs)", aliases=("--max-num-seqs",)),
    )
    max_k: int = field(default=DEFAULT_MAX_K, metadata=flag("largest k a request may ask for"))
    default_k: int = field(default=DEFAULT_K, metadata=flag("k for requests that name none"))
    # None = the rest of the context
    default_max_tokens: int | None = field(
        default=DEFAULT_MAX_TOKENS,
        metadata=flag("output budget of requests that name none (default: the room the prompt leaves in the context)"),
    )
    # None = the target model's
    max_model_len: int | None = field(default=None, metadata=flag("cap on prompt + output (default: the model's)"))
    dtype: str = field(
        default="auto",
        metadata=flag(
            "model weights and KV cache: auto = the checkpoint's dtype on CUDA (bfloat16 for "
            "Llama 3, Qwen, Mistral), float32 on a CPU",
            choices=DTYPES,
        ),
    )
    device: str = field(default="auto", metadata=flag("worker device: auto, cpu, cuda"))
    # None = 1 when CUDA is visible to this process, else 0
    worker_num_gpus: float | None = field(
        default=None, metadata=flag("GPUs per worker actor (default: 1 if the Ray cluster has GPUs, else 0)")
    )
    step_timeout_s: float = field(
        default=DEFAULT_STEP_TIMEOUT_S,
        metadata=flag(
            "liveness limit: a worker is taken out when its heartbeat does not answer within it, or its "
            "progress stops for ten of them (a slow iteration alone is waited for); also bounds other worker "
            "calls"
        ),
    )
    worker_start_timeout_s: float = field(
        default=DEFAULT_WORKER_START_TIMEOUT_S,
        metadata=flag("how long a worker actor may take to start and load its models"),
    )
    worker_max_restarts: int = field(
        default=DEFAULT_WORKER_MAX_RESTARTS,
        metadata=flag(
            "times Ray restarts a crashed worker actor, and times the orchestrator replaces a lost one "
            "(killed, dead or stopped) with a new actor (-1 = always); a restarted worker rejoins placement"
        ),
    )
    worker_recovery_wait_s: float = field(
        default=DEFAULT_WORKER_RECOVERY_WAIT_S,
        metadata=flag(
            "with no healthy worker while a lost one is restarted: how long queued and new requests wait "
            "for it (0 = fail them at once)"
        ),
    )
    # Pooled workers (orchestrator.worker_pool.WorkerPool): detached named actors of this pool,
    # adopted by the next orchestrator instead of loaded again; "" = owned by this process.
    worker_pool: str = field(
        default="",
        metadata=flag(
            "keep the GPU workers as detached Ray actors of this pool: the next orchestrator (a restart, a "
            "rolling update's new pod) adopts the ones built with the same configuration instead of loading "
            "the models again (docs/deployment.md); empty = the workers die with this orchestrator",
            metavar="NAME",
        ),
    )
    # Worker autoscaling within [min_workers, max_workers] (None = num_workers: a fixed count);
    # num_workers is the count at start-up.
    min_workers: int | None = field(
        default=None, metadata=flag("fewest GPU workers when idle (default: --num-workers)")
    )
    max_workers: int | None = field(
        default=None,
        metadata=flag(
            "most GPU workers under load (default: --num-workers); above --min-workers the count follows "
            "the load: one is added while the queue wait stays high, one retired after an idle period"
        ),
    )
    scale_up_queue_wait_s: float = field(
        default=DEFAULT_SCALE_UP_QUEUE_WAIT_S,
        metadata=flag("a worker is added when the oldest waiting request has waited longer than this..."),
    )
    scale_up_after_s: float = field(default=DEFAULT_SCALE_UP_AFTER_S, metadata=flag("...for this long without a break"))
    scale_down_idle_s: float = field(
        default=DEFAULT_SCALE_DOWN_IDLE_S,
        metadata=flag(
            "a worker is retired when the requests in the batches have fit one worker fewer, with nothing "
            "waiting, for this long"
        ),
    )
    worker_torch_threads: int = field(
        default=DEFAULT_WORKER_TORCH_THREADS,
        metadata=flag(
            "torch threads per CPU worker (0 = every CPU the worker process may run on; GPU workers keep their default)"
        ),
    )
    # Trailing prompt tokens a new sequence's first step feeds (gpu_worker.config says why).
    step_prefill_tokens: int = field(
        default=DEFAULT_STEP_PREFILL_TOKENS,
        metadata=flag(
            "a new sequence's last N prompt tokens are fed by its first step, mixed into the batch's "
            "forwards; a longer prompt's head is prefilled in chunks within --max-iteration-tokens (1 = all "
            "but the last token)"
        ),
    )
    # Target tokens per worker iteration, prefill chunks and decode rows together (gpu_worker.config).
    max_iteration_tokens: int = field(
        default=DEFAULT_MAX_ITERATION_TOKENS,
        metadata=flag(
            "target tokens one worker iteration may process, each weighted by the keys it attends over "
            "(a token deep in a long prompt counts more than one): running sequences' decode rows first, then "
            "chunks of prompts being prefilled, in the same forward; 0 = by device, 512 on a GPU and 48 on a "
            "CPU (docs/scheduling.md); vLLM's --max-num-batched-tokens, but weighted",
            aliases=("--max-num-batched-tokens",),
        ),
    )
    # Prompt tokens waiting for a worker, and placed on one worker (orchestrator.token_admission); 0 = off.
    max_queued_prompt_tokens: int = field(
        default=DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
        metadata=flag("prompt tokens waiting for a worker beyond which requests get RESOURCE_EXHAUSTED (0 = no bound)"),
    )
    max_worker_prompt_tokens: int = field(
        default=DEFAULT_MAX_WORKER_PROMPT_TOKENS,
        metadata=flag("prompt tokens of the requests placed on one worker; more wait in the queue (0 = no bound)"),
    )
    # Each worker's KV budget (gpu_worker.kv_budget): bytes, or vLLM's fraction of its CUDA
    # device's memory; None for both = unbounded pools. Requests are placed only where they fit.
    kv_cache_bytes: int | None = field(
        default=None,
        metadata=flag("KV budget of each worker in bytes, on any device (instead of --gpu-memory-utilization)"),
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata=flag(
            "KV budget of each worker (CUDA): the fraction of its device's memory it may use, less the "
            "loaded models and an activation reserve; requests wait in the queue until their prompt + "
            "max_tokens fit beside the running ones (docs/models.md). Default: no budget"
        ),
    )
    mask_deadline_s: float = field(
        default=DEFAULT_MASK_DEADLINE_S,
        metadata=flag(
            "seconds one mask-service call may take: the orchestrator's ValidateGrammar (which may compile "
            "a large schema) and each worker's calls"
        ),
    )
    mask_max_retries: int = DEFAULT_MASK_MAX_RETRIES
    validation_threads: int = DEFAULT_VALIDATION_THREADS
    shutdown_grace_s: float = field(
        default=DEFAULT_SHUTDOWN_GRACE_S,
        metadata=flag("on SIGTERM, streams get this long to finish, then end with a final message"),
    )
    # On SIGTERM, before the drain: new requests are still admitted this long (readiness says
    # NOT_SERVING), while a load balancer's endpoints catch up; pooled workers are marked draining
    # at once, so the orchestrator replacing this one waits for them (orchestrator.worker_pool).
    shutdown_delay_s: float = field(
        default=0.0,
        metadata=flag(
            "on SIGTERM, keep admitting requests this long (readiness already NOT_SERVING) while load "
            "balancers stop routing here, then drain (Kubernetes: the time endpoints take to update)"
        ),
    )
    checked_max_attempts: int = field(
        default=DEFAULT_CHECKED_MAX_ATTEMPTS,
        metadata=flag("checked mode: most generations one request may ask for (Grammar.max_attempts)"),
    )
    grammar_fallback: validation.GrammarFallback = field(
        default=DEFAULT_GRAMMAR_FALLBACK,
        metadata=flag(
            "a JSON Schema no engine enforces exactly, for a request that does not say (guided_checked / "
            "Grammar.checked unset): checked = generate under a relaxation, check the output against the "
            "schema, resample (never an invalid output returned); refuse = INVALID_ARGUMENT"
        ),
    )
    # Off: the caller's messages are the prompt, and a request opts in (orchestrator.chat).
    schema_instruction: bool = field(
        default=False,
        metadata=flag(
            "put the JSON Schema of a chat's structured output into a system message (off: the caller's "
            "messages are the prompt; a request opts in with schema_instruction)"
        ),
    )
    # The model thinks in this format before its answer (orchestrator/reasoning.py).
    reasoning_parser: ReasoningParser | None = field(
        default=None,
        metadata=flag(
            "the model thinks before it answers, in this family's format: the thinking is free, any "
            "grammar applies to the answer after it, and the HTTP API returns the thinking as "
            "reasoning / reasoning_content apart from content (docs/openai-api.md)"
        ),
    )
    # The format tool calls are written in (api/http/tool_formats.py); auto: the template's.
    tool_call_parser: ToolCallParser = field(
        default=ToolCallParser.AUTO,
        metadata=flag(
            "the format the model writes tool calls in (the HTTP API's tools); auto = read from the "
            "chat template, Hermes when it shows none (docs/openai-api.md)"
        ),
    )
    # Requests one end client (orchestrator.client_identity) may have in flight; 0 = no cap,
    # AUTO_INFLIGHT_PER_CLIENT = every batch slot plus half the admission queue (inflight_cap_per_client).
    max_inflight_per_client: int = field(
        default=AUTO_INFLIGHT_PER_CLIENT,
        metadata=flag(
            "requests one end client (API key, else specmask-client metadata / X-SpecMask-Client header, "
            "else address) may have in flight; past it RESOURCE_EXHAUSTED (-1 = every batch slot plus half "
            "the admission queue, 0 = no limit)"
        ),
    )
    # Keys the public APIs require (orchestrator.auth_keys); () = open. Not in repr: never logged.
    # Their flags are auth_keys' (--api-key, --api-key-file), read with the environment's keys.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # origins browsers may call the HTTP API from; () = no CORS
    cors_origins: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "an origin browsers may call the HTTP API from (repeatable; '*' = any; default: no CORS)",
            name="--cors-origin",
            metavar="ORIGIN",
        ),
    )
    # The mask tier's verdicts on grammars, kept this long and this many (orchestrator.verdict_cache):
    # a grammar judged recently costs a request no ValidateGrammar round trip. 0 entries = off.
    grammar_verdict_cache_entries: int = field(
        default=DEFAULT_GRAMMAR_VERDICT_CACHE_ENTRIES,
        metadata=flag(
            "keep the mask tier's last N verdicts on grammars, so a request whose grammar was judged "
            "recently skips the ValidateGrammar round trip (0 = ask every time)",
            name="--grammar-verdict-cache",
            metavar="N",
        ),
    )
    grammar_verdict_ttl_s: float = field(
        default=DEFAULT_GRAMMAR_VERDICT_TTL_S,
        metadata=flag(
            "how long a kept verdict holds: the longest a change of the mask tier's limits takes to reach "
            "this orchestrator's admission"
        ),
    )
    # Logging of the GPU-worker processes (Ray actors): INFO keeps their [request_id=...] lines.
    # On the command line the level of this process too.
    worker_log_level: str | None = field(
        default="INFO",
        metadata=flag(
            "logging level of this process and of its GPU workers (DEBUG, INFO, WARNING, ...)", name="--log-level"
        ),
    )
    log_format: str = field(
        default="text", metadata=flag("text (for people) or json (one object a line)", choices=LOG_FORMATS)
    )
    # OTLP/gRPC collector for this process's and its GPU workers' trace spans (common.tracing); None = off.
    otlp_traces_endpoint: str | None = field(default=None, metadata=flag(OTLP_ENDPOINT_HELP, metavar="URL"))


@dataclass(frozen=True)
class OrchestratorConfig(_OrchestratorFields):
    """The orchestrator's configuration: the fields (``_OrchestratorFields``, each a flag), checked
    together when built (a bad value or combination is a ValueError, never a server that starts
    and misbehaves), and what the components derive from them (the workers' WorkerConfig, the
    autoscaler's policy, the admission bounds)."""

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
        if not 0 <= self.ray_join_timeout_s < float("inf"):  # also refuses NaN
            raise ValueError(f"ray_join_timeout_s must be >= 0 and finite, got {self.ray_join_timeout_s}")
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
        if not self.shutdown_delay_s >= 0:
            raise ValueError(f"shutdown_delay_s must be >= 0, got {self.shutdown_delay_s}")
        if self.worker_pool and not _POOL_NAME.fullmatch(self.worker_pool):
            raise ValueError(
                f"worker_pool must be 1-40 lowercase letters, digits or '-' (a Ray actor name part), "
                f"got {self.worker_pool!r}"
            )
        self.autoscale_policy()  # bounds and thresholds: AutoscalePolicy raises ValueError
        if not self.min_workers_or_default <= self.num_workers <= self.max_workers_or_default:
            raise ValueError(
                f"num_workers ({self.num_workers}) must lie within min_workers..max_workers "
                f"({self.min_workers_or_default}..{self.max_workers_or_default})"
            )
        if self.max_inflight_per_client < AUTO_INFLIGHT_PER_CLIENT:
            raise ValueError(
                f"max_inflight_per_client must be >= 0 (0 = no cap) or -1 (auto), got {self.max_inflight_per_client}"
            )
        if self.kv_cache_bytes is not None or self.gpu_memory_utilization is not None:
            self.worker_config()  # the budget's bounds: WorkerConfig raises ValueError
        if not 0 <= self.default_k <= self.max_k:
            raise ValueError(f"need 0 <= default_k <= max_k, got {self.default_k}, {self.max_k}")

    @property
    def min_workers_or_default(self) -> int:
        return self.num_workers if self.min_workers is None else self.min_workers

    @property
    def max_workers_or_default(self) -> int:
        return self.num_workers if self.max_workers is None else self.max_workers

    @property
    def autoscaling(self) -> bool:
        """Whether the worker count follows the load (min < max)."""
        return self.min_workers_or_default < self.max_workers_or_default

    def autoscale_policy(self) -> autoscale.AutoscalePolicy:
        return autoscale.AutoscalePolicy(
            min_workers=self.min_workers_or_default,
            max_workers=self.max_workers_or_default,
            scale_up_wait_s=self.scale_up_queue_wait_s,
            scale_up_after_s=self.scale_up_after_s,
            scale_down_idle_s=self.scale_down_idle_s,
        )

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
            otlp_traces_endpoint=self.otlp_traces_endpoint,
        )
