"""The mask-service process configuration: one frozen dataclass, its fields the flags of
`specmask mask-service` (common.config_flags; main.py reads them back)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from specmask.common.config_flags import flag
from specmask.common.log_format import LOG_FORMATS
from specmask.common.startup import PORT_OFF, port_flag
from specmask.common.tracing import OTLP_ENDPOINT_HELP
from specmask.mask_service.auth import token_from_env
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
MIB = 2**20  # the command line gives sizes in MiB (--grammar-cache-mb), the config in bytes


def mib_to_bytes(mib: int) -> int:
    """A ``--...-mb`` flag's value as the bytes its field holds."""
    return mib * MIB


def token_or_env(token: str | None) -> str:
    """``--auth-token``'s value; not given: $SPECMASK_MASK_TOKEN ("" when unset: no authentication)."""
    return token_from_env() if token is None else token


def endpoint_or_none(url: str | None) -> str | None:
    """An empty ``--otlp-traces-endpoint`` (a chart's blank value) is tracing off, like none."""
    return url or None


@dataclass(frozen=True)
class MaskServiceConfig:
    """The process's configuration; a field with a flag is set by it (``--tokenizer`` for
    ``tokenizers``, ``--grammar-cache-mb`` for ``grammar_cache_bytes``, else ``--<field name>``),
    ``grammar_limits`` by GrammarLimits' own flags, the rest in code (tools, tests)."""

    tokenizers: tuple[TokenizerSource, ...] = field(
        metadata=flag(
            "HF tokenizer dir or tokenizer.json; optional padded model vocab size (repeatable)",
            name="--tokenizer",
            metavar="DIR[:VOCAB_SIZE]",
            each=TokenizerSource.parse,
        )
    )
    host: str = field(default="0.0.0.0", metadata=flag("interface for the gRPC API and metrics"))
    port: int = field(default=50061, metadata=flag("gRPC port (0 = pick a free one)"))
    max_sessions: int = field(default=DEFAULT_MAX_SESSIONS, metadata=flag("open sessions this replica holds"))
    session_ttl_s: float = field(
        default=DEFAULT_SESSION_TTL_S, metadata=flag("idle seconds before a session is reclaimed")
    )
    max_batch: int = field(default=DEFAULT_MAX_BATCH, metadata=flag("items one DraftMasks call may carry"))
    max_k: int = field(default=DEFAULT_MAX_K, metadata=flag("drafts one DraftMasks item may carry"))
    mask_threads: int = field(
        default=os.cpu_count() or 1,
        metadata=flag("threads computing masks (default: every CPU); match the CPU request"),
    )
    compile_threads: int = 2
    compile_timeout_s: float = field(
        default=DEFAULT_COMPILE_TIMEOUT_S,
        metadata=flag("a compile's CPU-time budget; past it the grammar is refused as too complex"),
    )
    compile_wall_timeout_s: float = field(
        default=DEFAULT_COMPILE_WALL_TIMEOUT_S,
        metadata=flag(
            "seconds a compile worker's CPU time may stand still (stopped, blocked) before its compile "
            "ends with RESOURCE_EXHAUSTED, retry (0 = max(30, 4x the CPU budget))"
        ),
    )
    compile_nice: int = field(default=DEFAULT_COMPILE_NICE, metadata=flag("nice value of the compile workers"))
    compile_sched_idle: bool = field(
        default=DEFAULT_COMPILE_SCHED_IDLE,
        metadata=flag(
            "compile workers under Linux SCHED_IDLE (only CPU nothing else wants: on a saturated "
            "box no compile finishes; off by default)"
        ),
    )
    compile_workers: int = field(
        default=DEFAULT_COMPILE_WORKERS,
        metadata=flag("killable compile processes (0 = compile in-process, unbounded)"),
    )
    compile_memory_bytes: int = field(
        default=DEFAULT_COMPILE_MEMORY_BYTES,
        metadata=flag(
            "RSS in MiB past which a compile worker is killed with its compile",
            name="--compile-memory-mb",
            convert=mib_to_bytes,
            cli_default=DEFAULT_COMPILE_MEMORY_BYTES // MIB,
        ),
    )
    compile_queue: int = field(
        default=DEFAULT_COMPILE_QUEUE, metadata=flag("compiles waiting for a worker, all owners together")
    )
    compile_queue_per_owner: int = field(
        default=DEFAULT_COMPILE_QUEUE_PER_OWNER, metadata=flag("compiles of one owner waiting for a worker")
    )
    compile_waiters: int = DEFAULT_COMPILE_WAITERS
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    # None = max_sessions (one owner may fill it)
    max_sessions_per_owner: int | None = field(
        default=None, metadata=flag("sessions one owner may hold (default: all)")
    )
    # RSS (this process + compile workers) past which new sessions are shed;
    # 0 = 85% of the container's cgroup memory limit, if it has one.
    max_memory_bytes: int = field(
        default=0,
        metadata=flag(
            "shed new sessions past this RSS in MiB (0 = 85%% of the cgroup memory limit, if any)",
            name="--max-memory-mb",
            convert=mib_to_bytes,
            cli_default=0,
        ),
    )
    # Shared token every MaskService RPC must carry ("" = open; see mask_service.auth).
    auth_token: str = field(
        default="",
        metadata=flag(
            "shared token callers must send (default: $SPECMASK_MASK_TOKEN; unset = no authentication)",
            convert=token_or_env,
            cli_default=None,
        ),
    )
    grammar_cache_bytes: int = field(
        default=DEFAULT_GRAMMAR_CACHE_BYTES,
        metadata=flag(
            "MiB of compiled grammars kept",
            name="--grammar-cache-mb",
            convert=mib_to_bytes,
            cli_default=DEFAULT_GRAMMAR_CACHE_BYTES // MIB,
        ),
    )
    row_cache_bytes: int = DEFAULT_ROW_CACHE_BYTES
    grpc_workers: int = 2 * DEFAULT_COMPILE_WAITERS
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    janitor_interval_s: float = 5.0
    # OTLP/gRPC collector for the spans of traced calls (common.tracing); None = tracing off.
    otlp_traces_endpoint: str | None = field(
        default=None, metadata=flag(OTLP_ENDPOINT_HELP, metavar="URL", convert=endpoint_or_none)
    )
    # The process around the service (main.run): its metrics endpoint, its stop, its logs.
    # Prometheus /metrics; None = off, 0 = pick a free port.
    metrics_port: int | None = field(
        default=None,
        metadata=flag(
            "Prometheus /metrics port (-1 = off, 0 = pick a free one)", convert=port_flag, cli_default=PORT_OFF
        ),
    )
    shutdown_grace_s: float = field(
        default=DEFAULT_SHUTDOWN_GRACE_S,
        metadata=flag("on SIGTERM, in-flight RPCs get this long to finish (keep below the pod's grace period)"),
    )
    log_level: str = field(default="INFO", metadata=flag("logging level (DEBUG, INFO, WARNING, ...)"))
    log_format: str = field(
        default="text", metadata=flag("text (for people) or json (one object a line)", choices=LOG_FORMATS)
    )
