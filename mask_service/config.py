"""The mask-service process configuration: one frozen dataclass, built from flags in main.py."""

from __future__ import annotations

import os
from dataclasses import dataclass

from mask_service.tokenizers import TokenizerSource

# Defaults, each with its reason.
DEFAULT_MAX_SESSIONS = 4096  # ~ concurrent generations across the workers one replica serves
DEFAULT_SESSION_TTL_S = 600.0  # a worker that crashed leaves sessions; reclaim after 10 min idle
DEFAULT_MAX_BATCH = 512  # bounds one RPC's CPU time and response size
DEFAULT_MAX_K = 16  # speculation beyond 16 drafts has vanishing acceptance
DEFAULT_COMPILE_TIMEOUT_S = 30.0  # big schemas on 150k vocabs compile in seconds, not minutes
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
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    row_cache_bytes: int = DEFAULT_ROW_CACHE_BYTES
    grpc_workers: int = 16
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    janitor_interval_s: float = 5.0
