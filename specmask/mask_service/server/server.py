"""Build the mask-service gRPC server from a config: ``create_server(config) -> (server, port)``.

Kept apart from the process entry point (main.py) so tests can bind port 0 on
127.0.0.1 and run several servers in one process.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specmask.mask_service.auth import TokenAuthInterceptor
from specmask.mask_service.client.replicas import join_host_port
from specmask.mask_service.server import metrics
from specmask.mask_service.server.compile_pool import CompilePool, default_wall_budget_s
from specmask.mask_service.server.compiler_cache import CompilerCache
from specmask.mask_service.server.config import MaskServiceConfig
from specmask.mask_service.server.draft_masks import DraftMaskEngine
from specmask.mask_service.server.memory import MemoryGuard, shed_limit
from specmask.mask_service.server.servicer import MaskServicer
from specmask.mask_service.server.sessions import SessionStore
from specmask.mask_service.server.tokenizers import TokenizerRegistry
from specmask.mask_service.wire import RowInterner
from specmask.proto import health as health_names
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MaskService"].full_name
_COMPILE_WORKER_START_S = 120.0  # importing xgrammar (and torch) in the first compile worker


@dataclass
class MaskServiceHandle:
    """The parts a process (or test) needs to stop cleanly."""

    server: grpc.Server
    port: int
    servicer: MaskServicer
    health: health.HealthServicer
    sessions: SessionStore
    registry: TokenizerRegistry
    _stop: threading.Event
    _parts: tuple[CompilerCache, DraftMaskEngine]

    def stop(self, grace_s: float | None = 5.0) -> None:
        """Report NOT_SERVING, end compiles, drain in-flight RPCs for ``grace_s``, then release pools.

        Compile workers are killed first: a request waiting on a compile is answered
        at once ("shutting down", retry elsewhere) instead of holding the drain for a
        compile's whole budget, while draft-mask calls and commits finish normally.
        """
        self.health.enter_graceful_shutdown()
        self._stop.set()
        self._parts[0].shutdown()
        self.server.stop(grace_s).wait()
        for part in self._parts[1:]:
            part.shutdown()


def create_server(config: MaskServiceConfig) -> tuple[grpc.Server, int]:
    """Load tokenizers, wire the parts, bind. Returns (server, bound port); call server.start()."""
    handle = build_service(config)
    return handle.server, handle.port


def build_service(config: MaskServiceConfig, registry: TokenizerRegistry | None = None) -> MaskServiceHandle:
    """Like create_server, but returns the handle (graceful stop, session store) for processes and tests.

    ``registry`` lets tests share one loaded tokenizer set across servers.
    """
    registry = registry or TokenizerRegistry(list(config.tokenizers))
    # The compile's wall-clock backstop (0 = derived from the CPU budget), resolved once: the
    # pool enforces it and the cache's default wait for a compile follows it.
    wall_budget_s = config.compile_wall_timeout_s or default_wall_budget_s(config.compile_timeout_s)
    cache = CompilerCache(
        registry,
        max_bytes=config.grammar_cache_bytes,
        compile_threads=config.compile_threads,
        compile_timeout_s=config.compile_timeout_s,
        limits=config.grammar_limits,
        max_waiters=config.compile_waiters,
        waiters_reserve=min(config.compile_queue_per_owner, config.compile_waiters // 2),
        wall_timeout_s=wall_budget_s,
    )
    pool = None
    if config.compile_workers > 0:
        pool = CompilePool(
            cache.tokenizer_json,
            workers=config.compile_workers,
            budget_s=config.compile_timeout_s,
            memory_cap_bytes=config.compile_memory_bytes,
            max_queue=config.compile_queue,
            max_queue_per_owner=config.compile_queue_per_owner,
            wall_budget_s=wall_budget_s,
            nice=config.compile_nice,
            sched_idle=config.compile_sched_idle,
        )
        cache.attach_pool(pool)
        # Warm-up is explicit: the service reports SERVING with a compile worker up, so
        # the first new grammar does not also wait seconds for the engine's import.
        if not pool.wait_ready(_COMPILE_WORKER_START_S):
            logger.warning("compile worker not up after %.0f s; first compiles will wait", _COMPILE_WORKER_START_S)
    limit = shed_limit(config.max_memory_bytes)
    guard = MemoryGuard(limit, pool.worker_pids if pool is not None else list) if limit else None
    sessions = SessionStore(
        max_sessions=config.max_sessions,
        ttl_s=config.session_ttl_s,
        max_per_owner=config.max_sessions_per_owner,
        memory_guard=guard,
    )
    metrics.bind_replica_gauges(cache, sessions, pool)
    engine = DraftMaskEngine(
        sessions,
        RowInterner(config.row_cache_bytes),
        num_threads=config.mask_threads,
        max_batch=config.max_batch,
        max_k=config.max_k,
        tokenizers=registry,
    )
    servicer = MaskServicer(cache, sessions, engine)
    opts = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    interceptors = [TokenAuthInterceptor(config.auth_token)] if config.auth_token else []
    server = grpc.server(
        ThreadPoolExecutor(max_workers=config.grpc_workers, thread_name_prefix="grpc"),
        options=opts,
        interceptors=interceptors,
    )
    pb_grpc.add_MaskServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(health_names.READINESS, health_pb2.HealthCheckResponse.SERVING)
    # The process alone (specmask/proto/health.py): what liveness and startup probes ask.
    health_servicer.set(health_names.LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(join_host_port(config.host, config.port))
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    stop = threading.Event()

    def janitor() -> None:
        while not stop.wait(config.janitor_interval_s):
            sessions.evict_idle()

    threading.Thread(target=janitor, name="session-janitor", daemon=True).start()
    handle = MaskServiceHandle(server, port, servicer, health_servicer, sessions, registry, stop, (cache, engine))
    logger.info("mask service bound on %s:%d, tokenizers %s", config.host, port, registry.ids())
    return handle
