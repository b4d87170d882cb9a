"""`specmask mask-service`: the process entry point (flags -> config -> server, SIGTERM -> graceful stop)."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import threading

from specmask.common import tracing
from specmask.common.log_format import LOG_FORMATS, configure_logging
from specmask.common.parent_watch import die_with_parent_from_env
from specmask.common.startup import PORT_OFF, StartupError, check_ports_free, check_tokenizer, port_flag
from specmask.mask_service.auth import token_from_env
from specmask.mask_service.grammar import limits
from specmask.mask_service.server import config as cfg
from specmask.mask_service.server.config import MaskServiceConfig
from specmask.mask_service.server.tokenizers import TokenizerSource

logger = logging.getLogger(__name__)
TRACE_SERVICE_NAME = "specmask-mask-service"  # service.name of this process's spans


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=50061)
    parser.add_argument(
        "--tokenizer",
        action="append",
        required=True,
        metavar="DIR[:VOCAB_SIZE]",
        help="HF tokenizer dir or tokenizer.json; optional padded model vocab size (repeatable)",
    )
    parser.add_argument("--max-sessions", type=int, default=cfg.DEFAULT_MAX_SESSIONS)
    parser.add_argument("--session-ttl-s", type=float, default=cfg.DEFAULT_SESSION_TTL_S)
    parser.add_argument("--max-batch", type=int, default=cfg.DEFAULT_MAX_BATCH)
    parser.add_argument("--max-k", type=int, default=cfg.DEFAULT_MAX_K)
    parser.add_argument("--mask-threads", type=int, default=MaskServiceConfig.mask_threads)
    parser.add_argument(
        "--compile-timeout-s",
        type=float,
        default=cfg.DEFAULT_COMPILE_TIMEOUT_S,
        help="a compile's CPU-time budget; past it the grammar is refused as too complex",
    )
    parser.add_argument(
        "--compile-wall-timeout-s",
        type=float,
        default=cfg.DEFAULT_COMPILE_WALL_TIMEOUT_S,
        help="seconds a compile worker's CPU time may stand still (stopped, blocked) before its compile "
        "ends with RESOURCE_EXHAUSTED, retry (0 = max(30, 4x the CPU budget))",
    )
    parser.add_argument("--compile-nice", type=int, default=cfg.DEFAULT_COMPILE_NICE)
    parser.add_argument(
        "--compile-sched-idle",
        action=argparse.BooleanOptionalAction,
        default=cfg.DEFAULT_COMPILE_SCHED_IDLE,
        help="compile workers under Linux SCHED_IDLE (only CPU nothing else wants: on a saturated "
        "box no compile finishes; off by default)",
    )
    parser.add_argument("--grammar-cache-mb", type=int, default=cfg.DEFAULT_GRAMMAR_CACHE_BYTES // 2**20)
    parser.add_argument(
        "--compile-workers",
        type=int,
        default=cfg.DEFAULT_COMPILE_WORKERS,
        help="killable compile processes (0 = compile in-process, unbounded)",
    )
    parser.add_argument("--compile-memory-mb", type=int, default=cfg.DEFAULT_COMPILE_MEMORY_BYTES // 2**20)
    parser.add_argument("--compile-queue", type=int, default=cfg.DEFAULT_COMPILE_QUEUE)
    parser.add_argument("--compile-queue-per-owner", type=int, default=cfg.DEFAULT_COMPILE_QUEUE_PER_OWNER)
    parser.add_argument("--max-schema-bytes", type=int, default=limits.DEFAULT_MAX_SCHEMA_BYTES)
    parser.add_argument("--max-schema-properties", type=int, default=limits.DEFAULT_MAX_PROPERTIES)
    parser.add_argument("--max-schema-depth", type=int, default=limits.DEFAULT_MAX_NESTING_DEPTH)
    parser.add_argument("--max-enum-values", type=int, default=limits.DEFAULT_MAX_ENUM_VALUES)
    parser.add_argument(
        "--max-sessions-per-owner", type=int, default=None, help="sessions one owner may hold (default: all)"
    )
    parser.add_argument(
        "--auth-token",
        default=None,
        help="shared token callers must send (default: $SPECMASK_MASK_TOKEN; unset = no authentication)",
    )
    parser.add_argument(
        "--max-memory-mb",
        type=int,
        default=0,
        help="shed new sessions past this RSS (0 = 85%% of the cgroup memory limit, if any)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=PORT_OFF, help="Prometheus /metrics port (-1 = off, 0 = pick a free one)"
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=cfg.DEFAULT_SHUTDOWN_GRACE_S,
        help="on SIGTERM, in-flight RPCs get this long to finish (keep below the pod's grace period)",
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--log-format", default="text", choices=LOG_FORMATS, help="text (for people) or json (one object a line)"
    )
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL", help=tracing.OTLP_ENDPOINT_HELP)


def config_from_args(args: argparse.Namespace) -> MaskServiceConfig:
    return MaskServiceConfig(
        tokenizers=tuple(TokenizerSource.parse(t) for t in args.tokenizer),
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        session_ttl_s=args.session_ttl_s,
        max_batch=args.max_batch,
        max_k=args.max_k,
        mask_threads=args.mask_threads,
        compile_timeout_s=args.compile_timeout_s,
        compile_wall_timeout_s=args.compile_wall_timeout_s,
        compile_nice=args.compile_nice,
        compile_sched_idle=args.compile_sched_idle,
        grammar_cache_bytes=args.grammar_cache_mb * 2**20,
        compile_workers=args.compile_workers,
        compile_memory_bytes=args.compile_memory_mb * 2**20,
        compile_queue=args.compile_queue,
        compile_queue_per_owner=args.compile_queue_per_owner,
        max_sessions_per_owner=args.max_sessions_per_owner,
        max_memory_bytes=args.max_memory_mb * 2**20,
        auth_token=token_from_env() if args.auth_token is None else args.auth_token,
        grammar_limits=limits.GrammarLimits(
            max_schema_bytes=args.max_schema_bytes,
            max_properties=args.max_schema_properties,
            max_nesting_depth=args.max_schema_depth,
            max_enum_values=args.max_enum_values,
        ),
        otlp_traces_endpoint=args.otlp_traces_endpoint or None,
    )


def run(args: argparse.Namespace) -> int:
    die_with_parent_from_env()
    configure_logging(args.log_level, args.log_format)
    # Operator mistakes end here as one-line errors (specmask prints them), before loading anything.
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise StartupError(f"bad configuration: {exc}") from None
    try:
        tracing.check_installed(config.otlp_traces_endpoint)
    except RuntimeError as exc:
        raise StartupError(str(exc)) from None
    for source in config.tokenizers:
        check_tokenizer(source.path, "--tokenizer")
    metrics_port = port_flag(args.metrics_port)
    check_ports_free(config.host, [("--port", port_flag(config.port)), ("--metrics-port", metrics_port)])
    from specmask.mask_service.server.server import build_service  # heavy imports only once the role is chosen

    handle = build_service(config)
    # After the compile zygote forked (build_service): it and its workers carry no exporter thread.
    tracing.configure(config.otlp_traces_endpoint, TRACE_SERVICE_NAME)
    # Tokenizers (hundreds of thousands of long-lived Python objects) are loaded:
    # move them out of the cyclic GC's reach, so a full collection on the hot path
    # scans only request-time objects, not every loaded vocabulary's.
    gc.collect()
    gc.freeze()
    handle.server.start()
    if metrics_port is not None:
        from prometheus_client import start_http_server

        metrics_server, _ = start_http_server(metrics_port, addr=args.host)
        logger.info("metrics on http://%s:%d/metrics", args.host, metrics_server.server_port)
    logger.info("mask service serving on port %d", handle.port)
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("signal %d: graceful shutdown", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    done.wait()
    handle.stop(grace_s=args.shutdown_grace_s)
    tracing.shutdown()  # export the spans still buffered
    logger.info("mask service stopped")
    return 0
