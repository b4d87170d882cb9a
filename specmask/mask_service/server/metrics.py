"""Prometheus metrics of the mask service (module-level: one set per process, shared by servers in tests)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from specmask.mask_service.server.memory import rss_bytes

DRAFT_CALL_SECONDS = Histogram(
    "specmask_mask_draft_call_seconds",
    "Server time of one DraftMasks call (commit + masks + encoding)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
)
DRAFT_ROWS = Counter("specmask_mask_rows_total", "Bitmask rows returned")
NEW_ROWS = Counter("specmask_mask_new_rows_total", "Rows sent with content (not a dictionary reference)")
RPC_ERRORS = Counter("specmask_mask_errors_total", "Requests failed, by status code", ["code"])
SESSIONS_OPENED = Counter("specmask_mask_sessions_opened_total", "Sessions opened")
GRAMMAR_VALIDATIONS = Counter(
    "specmask_mask_grammar_validations_total",
    "ValidateGrammar answers, by engine and enforcement (exact, or checked: a relaxation)",
    ["backend", "enforcement"],
)

# Replica figures, read when scraped from the latest service built in this process.
SESSIONS = Gauge("specmask_mask_sessions", "Open sessions")
GRAMMAR_CACHE_BYTES = Gauge("specmask_mask_grammar_cache_bytes", "Compiled grammars held (engine's size estimate)")
GRAMMAR_REFUSALS = Gauge("specmask_mask_grammar_refusals_cached", "Refused grammars remembered by hash")
COMPILES_INFLIGHT = Gauge("specmask_mask_compiles_inflight", "Distinct grammars being compiled or waiting")
COMPILE_QUEUE_DEPTH = Gauge("specmask_mask_compile_queue_depth", "Compiles waiting for a worker process")
COMPILE_WORKERS_BUSY = Gauge("specmask_mask_compile_workers_busy", "Compile worker processes running a compile")
RSS_BYTES = Gauge("specmask_mask_rss_bytes", "Resident memory, by process", ["process"])


def bind_replica_gauges(cache: Any, sessions: Any, pool: Any) -> None:
    """Point the gauges at one replica's parts (CompilerCache, SessionStore, CompilePool or None)."""
    SESSIONS.set_function(lambda: len(sessions))
    GRAMMAR_CACHE_BYTES.set_function(lambda: cache.total_bytes)
    GRAMMAR_REFUSALS.set_function(lambda: cache.num_refusals)
    COMPILES_INFLIGHT.set_function(lambda: cache.num_inflight)
    RSS_BYTES.labels("server").set_function(rss_bytes)
    if pool is not None:
        COMPILE_QUEUE_DEPTH.set_function(lambda: pool.queue_depth)
        COMPILE_WORKERS_BUSY.set_function(lambda: pool.running)
        RSS_BYTES.labels("compile_workers").set_function(lambda: sum(pool.worker_rss_bytes()))
