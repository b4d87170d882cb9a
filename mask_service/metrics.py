"""Prometheus metrics of the mask service (module-level: one set per process, shared by servers in tests)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

DRAFT_CALL_SECONDS = Histogram(
    "specmask_mask_draft_call_seconds",
    "Server time of one DraftMasks call (commit + masks + encoding)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
)
DRAFT_ROWS = Counter("specmask_mask_rows_total", "Bitmask rows returned")
NEW_ROWS = Counter("specmask_mask_new_rows_total", "Rows sent with content (not a dictionary reference)")
RPC_ERRORS = Counter("specmask_mask_errors_total", "Requests failed, by status code", ["code"])
SESSIONS_OPENED = Counter("specmask_mask_sessions_opened_total", "Sessions opened")
