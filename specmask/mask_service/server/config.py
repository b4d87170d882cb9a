"""The mask-service process configuration: one frozen dataclass, built from flags in main.py."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from specmask.mask_service.grammar.limits import GrammarLimits
from specmask.mask_service.server.tokenizers import TokenizerSource

# Defaults, each with its reason.
DEFAULT_MAX_SESSIONS = 4096  # ~ concurrent generations across the workers one replica serves
DEFAULT_SESSION_TTL_S = 600.0  # a worker that crashed leaves sessions; reclaim after 10 min idle
DEFAULT_MAX_BATCH = 512  # bounds one RPC's CPU time and response size
DEFAULT_MAX_K = 16  # speculation beyond 16 drafts has vanishing acceptance
# A compile's budget in CPU seconds of its worker process (then killed: "grammar
# too complex"). CPU time, not wall time, so a busy box does not refuse valid
# schemas. Real schemas compile in well under a second on 150k vocabs; an
# accepted grammar is compiled a second time in the serving process.
DEFAULT_COMPILE_TIMEOUT_S = 4.0
# The stall backstop: a compile worker whose CPU time stands still this long
# (stopped, blocked) ends its compile with RESOURCE_EXHAUSTED, retry later, not
# cached. 0 = max(30 s, 4x the CPU budget).
DEFAULT_COMPILE_WALL_TIMEOUT_S = 0.0
# Compile workers run below the serving path's priority, so it wins the CPU, but
# at a plain nice that the kernel still gives a share beside any load (safe: the
# CPU budget does not charge them for waiting). SCHED_IDLE is an opt-in: under
# it a saturated box compiles nothing.
DEFAULT_COMPILE_NICE = 5
DEFAULT_COMPILE_SCHED_IDLE = False
DEFAULT_COMPILE_WORKERS = 2  # processes (~330 MB each: xgrammar imports torch)
# A worker above this RSS is killed with its compile (a 10k-property schema reached 4 GB).
DEFAULT_COMPILE_MEMORY_BYTES = 1536 * 1024**2
DEFAULT_COMPILE_QUEUE = 16  # compiles waiting for a worker, all owners
DEFAULT_COMPILE_QUEUE_PER_OWNER = 4  # so one flooding client cannot fill the queue alone
# Requests blocked on compiles; half the gRPC threads stay for masks. One owner may
# take all but a compile-queue share of them, so a lone client's burst of new
# schemas borrows idle places while another client still gets its share.
DEFAULT_COMPILE_WAITERS = 16
DEFAULT_SHUTDOWN_GRACE_S = 5.0  # in-flight DraftMasks calls take milliseconds; compiles are the long ones
DEFAULT_GRAMMAR_CACHE_BYTES = 512 * 1024**2
DEFAULT_ROW_CACHE_BYTES = 256 * 1024**2  # ~16k distinct Llama-3 rows
# 64 MiB: a B=512, k=16 batch of dense rows (worst case, first sighting) fits.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class MaskServiceConfig:
    tokenizers: tuple[TokenizerSource, ...]
    host: str = "0.0.0.0"
    port: int = 50061
    max_sessions: int = DEFAULT_MAX_SESSIONS
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    max_batch: int = DEFAULT_MAX_BATCH
    max_k: int = DEFAULT_MAX_K
    mask_threads: int = os.cpu_count() or 1
    compile_threads: int = 2
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S  # CPU seconds
    compile_wall_timeout_s: float = DEFAULT_COMPILE_WALL_TIMEOUT_S
    compile_nice: int = DEFAULT_COMPILE_NICE
    compile_sched_idle: bool = DEFAULT_COMPILE_SCHED_IDLE
    compile_workers: int = DEFAULT_COMPILE_WORKERS  # 0 = compile in-process only (unbounded; tools)
    compile_memory_bytes: int = DEFAULT_COMPILE_MEMORY_BYTES
    compile_queue: int = DEFAULT_COMPILE_QUEUE
    compile_queue_per_owner: int = DEFAULT_COMPILE_QUEUE_PER_OWNER
    compile_waiters: int = DEFAULT_COMPILE_WAITERS
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    max_sessions_per_owner: int | None = None  # None = max_sessions (one owner may fill it)
    # RSS (this process + compile workers) past which new sessions are shed;
    # 0 = 85% of the container's cgroup memory limit, if it has one.
    max_memory_bytes: int = 0
    auth_token: str = ""  # shared token every MaskService RPC must carry ("" = open; see mask_service.auth)
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    row_cache_bytes: int = DEFAULT_ROW_CACHE_BYTES
    grpc_workers: int = 2 * DEFAULT_COMPILE_WAITERS
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    janitor_interval_s: float = 5.0
    # OTLP/gRPC collector for the spans of traced calls (common.tracing); None = tracing off.
    otlp_traces_endpoint: str | None = None
