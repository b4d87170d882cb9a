"""The worker's one frozen configuration object (one config per process)."""

from __future__ import annotations

from dataclasses import dataclass

# Largest proposal length a request may ask for. Each draft position costs one
# draft forward (with draft masking, overlapped with one mask round trip) before
# the target forward; past ~8 the expected gain (1 - a^(k+1)) / (1 - a) saturates
# for any realistic acceptance rate a, so larger k only burns draft time.
DEFAULT_MAX_K = 8
# Active sequences per worker (vLLM's max_num_seqs). Without a KV budget (kv_cache_bytes,
# gpu_memory_utilization) this is the memory guard: add() refuses sequences past it.
DEFAULT_MAX_BATCH = 64
# Prompt-lookup (n-gram) proposer: match the longest context suffix of at most
# NGRAM_MAX tokens, at least NGRAM_MIN (prompt lookup decoding, Saxena 2023;
# vLLM's ngram proposer uses the same 1..4 window by default).
DEFAULT_NGRAM_MIN = 1
DEFAULT_NGRAM_MAX = 4
# Trailing prompt tokens a new sequence's first step feeds, inside that step's batched
# forwards, instead of a prefill forward of their own in add() (mixed prefill and
# decode, as chunked prefill does). A separate prefill costs one target and one draft
# forward per sequence on the worker's one thread, and every running sequence waits
# for it: under a flood of short requests that was 20% of the worker's time.
# Inside the step those tokens only widen the packed forwards the step runs anyway.
# Longer prompts are prefilled in chunks (within the iteration budget below) up to their
# last this-many tokens, cut to cost at most half the budget (planning.IterationPlanner.tail_tokens);
# the value matches planning.PREFILL_CHUNK_TOKENS, so no forward takes more of one prompt than a
# prefill chunk would. 1 = the whole prompt but its last token is prefilled first.
DEFAULT_STEP_PREFILL_TOKENS = 512
# Target-model tokens one worker iteration (one ``iterate`` call) may process, across the
# decode/verify rows of the step and the prefill chunks of prompts not yet cached (chunked
# prefill, as vLLM's max_num_batched_tokens), each token weighted by the keys it attends over
# (gpu_worker.token_cost), and all in one forward. Running sequences are served first; prompts
# take what is left, chunk by chunk over as many iterations as they need, so an iteration's
# time is bounded whatever arrives. 0 = by device (``iteration_budget``): on a GPU 512, one
# prefill chunk (planning.PREFILL_CHUNK_TOKENS), milliseconds of work; on a CPU, where a forward's
# time grows with its tokens, 48, so a burst of long prompts adds little to the running
# streams' inter-token latency. Smaller keeps the streams' inter-token latency closer to a pure
# decode step's while prompts arrive; larger prefills bursts sooner (docs/scheduling.md).
DEFAULT_MAX_ITERATION_TOKENS = 0
GPU_ITERATION_TOKENS = 512
CPU_ITERATION_TOKENS = 48


# Names WorkerConfig.dtype takes (vLLM's --dtype choices, and float64 for exactness checks).
DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16", "half", "float32", "float", "float64")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a ``GpuWorker`` needs; built once by the process that starts it."""

    target_dir: str  # local HF model dir (config, weights, tokenizer files)
    draft_dir: str | None = None  # local HF dir of the draft model; None = no draft-model proposer
    # "auto" = the checkpoint's dtype on CUDA (bfloat16 for today's models), float32 on a CPU,
    # where it keeps greedy exact (loading.resolve_dtype); or a torch floating dtype name.
    dtype: str = "auto"
    device: str = "auto"  # "auto" = cuda if available else cpu (resolved at load, never at import)
    mask_service_addresses: tuple[str, ...] = ()  # host:port of mask-service replicas; () = grammars refused
    max_batch: int = DEFAULT_MAX_BATCH
    max_k: int = DEFAULT_MAX_K
    # None = the target config's max_position_embeddings; a smaller value caps sequences sooner.
    max_model_len: int | None = None
    # True: one packed forward per model for the whole batch: every row's real new tokens as one
    # [1, Σ T_r] sequence over the slot pool (specmask/gpu_worker/model_runner.py).
    # False: one forward per sequence (the exact reference the batched path is tested against).
    batched_forward: bool = True
    # Decode and verify forwards at static bucketed shapes over the slot pool
    # (gpu_worker.static_forward), captured and replayed as CUDA graphs on a GPU and run
    # eagerly on a CPU: "auto" = wherever the architecture is supported (gpu_worker.architecture:
    # Llama, Mistral without a window, Qwen2/2.5, Qwen3),
    # "on" = required (an unsupported model is an error), "off" = the packed path only.
    static_forward: str = "auto"
    mask_deadline_s: float = 5.0  # per mask-service call, handed to the router
    # How long opening a session waits for its grammar's compile (mask_service.client).
    compile_wait_s: float = 120.0
    ngram_min: int = DEFAULT_NGRAM_MIN
    ngram_max: int = DEFAULT_NGRAM_MAX
    step_prefill_tokens: int = DEFAULT_STEP_PREFILL_TOKENS
    max_iteration_tokens: int = DEFAULT_MAX_ITERATION_TOKENS  # target tokens per iteration (see above)
    # The KV budget (gpu_worker.kv_budget), shared by the target's and the draft's pools: bytes
    # (any device), or vLLM's fraction of the CUDA device's memory the worker may use, less what
    # the loaded models take. Neither: unbounded pools, max_batch and max_model_len the only guard.
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    # torch intra-op threads (process-wide). None keeps the process's default: in a Ray
    # actor without num_cpus that is 1, since Ray sets OMP_NUM_THREADS=1 there. 0 = every
    # CPU this process may run on, when the device is the CPU and the target is not tiny
    # (loading.cpu_threads: a real model gains from a second thread, the toy pair stays at 1).
    # In-process tests pass 1.
    torch_threads: int | None = None
    # Seed for sequences that bring none (their per-request seeds are drawn from it).
    seed: int = 0
    # Root logging of the worker process (mask_service.log_format): a Ray actor starts with
    # WARNING and no handler, which drops the per-sequence [request_id=...] INFO lines.
    # None leaves the process's logging alone (in-process use, tests).
    log_level: str | None = None
    log_format: str = "text"
    # OTLP/gRPC collector this worker sends its trace spans to (common.tracing): the
    # orchestrator's --otlp-traces-endpoint; None = tracing off.
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {self.max_k}")
        if self.torch_threads is not None and self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0 (0 = every CPU), got {self.torch_threads}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.step_prefill_tokens < 1:
            raise ValueError(
                "step_prefill_tokens must be >= 1 (the first step feeds at least the last prompt token), "
                f"got {self.step_prefill_tokens}"
            )
        if self.max_iteration_tokens < 0:
            # Below a full batch is allowed: running rows are never dropped, only their drafts.
            raise ValueError(f"max_iteration_tokens must be >= 0 (0 = by device), got {self.max_iteration_tokens}")
        if self.static_forward not in ("auto", "on", "off"):
            raise ValueError(f"static_forward must be auto, on or off, got {self.static_forward!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes is not None and self.gpu_memory_utilization is not None:
            raise ValueError("give kv_cache_bytes or gpu_memory_utilization, not both")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


def iteration_budget(config: WorkerConfig, device_type: str) -> int:
    """The iteration budget in force on a device ("cuda", "cpu", ...): the configured one, or by
    device when it is 0. It may be below a full batch's one token per sequence: running rows
    are never dropped (a batch whose rows alone pass the budget steps whole, without drafts)."""
    if config.max_iteration_tokens > 0:
        return config.max_iteration_tokens
    return GPU_ITERATION_TOKENS if device_type == "cuda" else CPU_ITERATION_TOKENS
