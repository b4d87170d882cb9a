"""Build the orchestrator: workers, engine, gRPC server (API, health, reflection), metrics.

``create_server(config) -> (server, port)`` is separate from the process entry
point (specmask/orchestrator/main.py) so tests run it in-process on port 0. It is a coroutine: the
grpc.aio server and the step loops live on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specmask.common import tracing
from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.gpu_worker.types import WorkerInfo
from specmask.mask_service.client.replicas import join_host_port
from specmask.orchestrator.api.grpc_auth import ApiKeyInterceptor
from specmask.orchestrator.api.grpc_reasoning import GrpcReasoning
from specmask.orchestrator.api.grpc_servicer import OrchestratorServicer, add_to_server
from specmask.orchestrator.auth_keys import ApiKeys
from specmask.orchestrator.chat import DEFAULT_SCHEMA_INSTRUCTION, ChatRenderer
from specmask.orchestrator.config import OrchestratorConfig
from specmask.orchestrator.engine import Engine, EngineConfig, WorkerSlot
from specmask.orchestrator.grammar_check import MaskServiceGrammarChecker
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.readiness import MaskTierProbe, Readiness
from specmask.orchestrator.validation import RequestValidator, ServingDefaults
from specmask.orchestrator.verdict_cache import VerdictCache
from specmask.orchestrator.worker_pool import WorkerPool, connect_ray
from specmask.orchestrator.worker_scaling import WorkerScaler
from specmask.proto import health as health_names
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb

if TYPE_CHECKING:
    from specmask.orchestrator.api.http.app import HttpFrontDoor

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["OrchestratorService"].full_name
TRACE_SERVICE_NAME = "specmask-orchestrator"  # service.name of this process's trace spans
# Prompts can be long token-id lists; 16 MiB fits a 1M-token prompt as varints
# with room to spare, far past any model context (validation then refuses it).
MAX_MESSAGE_BYTES = 16 * 1024**2
# gRPC core cancels, with a bare CANCELLED and no message, calls that arrive while more than
# `grpc.server.max_pending_requests` (default 1,000) wait for the server to take them up: a burst
# of 2,000 concurrent requests lost ~10% that way (221 of 2,000 on a bare grpc.aio
# server). Raised, so that a burst reaches the handlers, whose admission answers what does not
# fit with RESOURCE_EXHAUSTED and a retry hint. A call waiting there holds at most its stream's
# flow-control window (64 KiB); past the hard limit core still cancels.
MAX_PENDING_RPCS = 20_000


def server_options(max_pending_rpcs: int = MAX_PENDING_RPCS) -> list[tuple[str, int]]:
    """The orchestrator's grpc.aio server options (message sizes, pending-call limits).

    ``grpc.so_reuseport`` off: with it a second server on the same port starts without
    complaint and the kernel splits connections between the two."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.server.max_pending_requests", max_pending_rpcs),
        ("grpc.server.max_pending_requests_hard_limit", 2 * max_pending_rpcs),
        ("grpc.so_reuseport", 0),
    ]


def api_interceptors(config: OrchestratorConfig) -> list[grpc.aio.ServerInterceptor]:
    """API-key authentication of OrchestratorService calls when keys are configured."""
    if not config.api_keys:
        return []
    return [ApiKeyInterceptor(ApiKeys(config.api_keys), f"/{SERVICE_NAME}/")]


def load_tokenizer(target_dir: str):
    """The target model's tokenizer (the `tokenizers` library: no transformers import)."""
    from tokenizers import Tokenizer

    path = Path(target_dir)
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))


class OrchestratorServer:
    """A built orchestrator: ``start()``, then ``stop()``; holds the gRPC server and the engine."""

    def __init__(
        self,
        config: OrchestratorConfig,
        grpc_server: grpc.aio.Server,
        engine: Engine,
        health_servicer: health.aio.HealthServicer,
        metrics: OrchestratorMetrics,
        grammar_checker: MaskServiceGrammarChecker,
        slots: list[WorkerSlot],
        pool: WorkerPool | None = None,
    ) -> None:
        self.config = config
        self.grpc_server = grpc_server
        self.engine = engine
        self.metrics = metrics
        self.metrics_port: int | None = None
        self.http: HttpFrontDoor | None = None  # the OpenAI-compatible API, when config.http_port is set
        self.http_port: int | None = None
        self._health = health_servicer
        self._grammar_checker = grammar_checker
        self._slots = slots
        # The workers' pool (orchestrator.worker_pool): owned or pooled actors, released or killed on stop.
        self.pool = pool if pool is not None else WorkerPool(config)
        # Follows the load when config.autoscaling (orchestrator.worker_scaling); None = a fixed count.
        self.scaler: WorkerScaler | None = None
        if config.autoscaling:
            self.scaler = WorkerScaler(engine, self.pool, config.autoscale_policy(), config.max_batch)
        self._stopped = False
        # What gRPC readiness says now; HTTP /health answers from the same flag (docs/api-errors.md).
        self.serving = False
        self._background: set[asyncio.Task] = set()  # strong refs: the loop keeps only weak ones
        # Readiness = a healthy worker AND a reachable mask replica.
        self.readiness = Readiness(
            lambda: engine.healthy, MaskTierProbe(config.mask_service_addresses), self._on_health_change
        )

    @property
    def info(self) -> WorkerInfo:
        return self._slots[0].info

    @property
    def worker_actors(self) -> list:
        """The workers the engine drives now (autoscaling adds and retires them)."""
        return self.engine.worker_actors()

    async def start(self) -> None:
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.metrics_port, self.config.host)
            logger.info("metrics on http://%s:%d/metrics", self.config.host, self.metrics_port)
        self.engine.start()
        await self.grpc_server.start()
        if self.http is not None:
            self.http_port = await self.http.start()
        # Liveness is the process alone: it stays SERVING while readiness follows the workers.
        for name in (health_names.READINESS, SERVICE_NAME, health_names.LIVENESS):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.serving = True
        self.readiness.start()
        if self.scaler is not None:
            self.scaler.start()

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful: NOT_SERVING, let in-flight RPCs finish (bounded), free everything."""
        if self._stopped:
            return
        self._stopped = True
        self.serving = False
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        await self._health.enter_graceful_shutdown()
        # A starting orchestrator (a rolling update's new pod) waits for these workers to be
        # released instead of loading the models into new ones.
        await self.pool.mark_draining()
        if self.scaler is not None:
            await self.scaler.stop()
        if self.config.shutdown_delay_s > 0:
            # Still admitting: requests a load balancer sends before its endpoints catch up complete.
            await asyncio.sleep(self.config.shutdown_delay_s)
        await self.readiness.stop()
        # Streams get up to `grace` to finish, then a final message each (not a bare
        # UNAVAILABLE "Cancelling all calls"); the RPCs then end on their own.
        await self.engine.drain(grace)
        http_stop = [self.http.stop()] if self.http is not None else []
        await asyncio.gather(self.grpc_server.stop(grace), *http_stop)
        await self.engine.stop()
        self._grammar_checker.close()
        await self.pool.close(self.worker_actors)
        self.metrics.close()

    def _on_health_change(self, healthy: bool) -> None:
        self.serving = healthy and not self._stopped
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in (health_names.READINESS, SERVICE_NAME):  # never LIVENESS: see specmask/proto/health.py
            task = asyncio.get_running_loop().create_task(self._health.set(name, status))
            self._background.add(task)
            task.add_done_callback(self._background.discard)


async def create_server(config: OrchestratorConfig) -> tuple[OrchestratorServer, int]:
    """Connect to Ray, start and wait for the workers, bind the API; not started yet."""
    # Before the workers start: their spans and this process's join the same traces.
    tracing.configure(config.otlp_traces_endpoint, TRACE_SERVICE_NAME)
    connect_ray(config.ray_address)  # blocks briefly; a no-op when the caller already connected
    pool = WorkerPool(config)
    slots = await pool.start()
    try:
        info = slots[0].info
        local_id = await asyncio.to_thread(tokenizer_id_for_path, config.target_dir)
        if local_id != info.tokenizer_id:
            raise RuntimeError(
                f"the orchestrator's tokenizer ({local_id}) differs from the workers' ({info.tokenizer_id}); "
                "--target must name the same model files"
            )
        tokenizer = await asyncio.to_thread(load_tokenizer, config.target_dir)
        checker = MaskServiceGrammarChecker(
            config.mask_service_addresses,
            tokenizer_id=info.tokenizer_id,
            vocab_size=info.vocab_size,
            deadline_s=config.mask_deadline_s,
            max_retries=config.mask_max_retries,
            verdicts=VerdictCache(max_entries=config.grammar_verdict_cache_entries, ttl_s=config.grammar_verdict_ttl_s),
        )
        defaults = ServingDefaults(
            max_tokens=config.default_max_tokens,
            k=min(config.default_k, info.max_k),
            checked_max_attempts=config.checked_max_attempts,
            grammar_fallback=config.grammar_fallback,
        )
        chat = await asyncio.to_thread(
            ChatRenderer.for_model, config.target_dir, DEFAULT_SCHEMA_INSTRUCTION if config.schema_instruction else ""
        )
        validator = RequestValidator(tokenizer, info, checker, defaults, chat)
        metrics = OrchestratorMetrics(model_name=config.model_name)
        health_servicer = health.aio.HealthServicer()
        engine = Engine(
            slots,
            validator,
            tokenizer,
            EngineConfig(
                max_queue=config.max_queue,
                step_timeout_s=config.step_timeout_s,
                validation_threads=config.validation_threads,
                max_inflight_per_client=config.inflight_cap_per_client,
                prompt_token_bounds=config.prompt_token_bounds(),
                recovery_wait_s=config.worker_recovery_wait_s,
                max_restarts=config.worker_max_restarts,
                max_iteration_tokens=config.max_iteration_tokens,
            ),
            metrics,
            release_sessions=checker.release_sessions,
            replace_worker=pool.replace,
        )
        grpc_server = grpc.aio.server(options=server_options(), interceptors=api_interceptors(config))
        server = OrchestratorServer(config, grpc_server, engine, health_servicer, metrics, checker, slots, pool)
        engine.set_health_listener(server.readiness.poke)
        # A kept acceptance is used only while a mask replica answers health: with the tier
        # down, requests still fail fast at validation (UNAVAILABLE), not at the worker.
        checker.tier_reachable = lambda: server.readiness.mask_replicas_serving > 0
        reasoning = GrpcReasoning(config.reasoning_parser, chat.template_variables)
        servicer = OrchestratorServicer(engine, metrics, model_name=config.model_name, reasoning=reasoning)
        add_to_server(servicer, grpc_server, SERVICE_NAME)
        if config.http_port is not None:
            from specmask.orchestrator.api.http.app import front_door_for  # aiohttp only when the HTTP API is on

            server.http = front_door_for(
                config, engine, metrics, info.max_model_len, tokenizer, ready=lambda: server.serving
            )
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), grpc_server)
        port = grpc_server.add_insecure_port(join_host_port(config.host, config.port))
        if port == 0:
            raise RuntimeError(f"could not bind {config.host}:{config.port}")
    except BaseException:
        await pool.close([s.actor for s in slots])
        raise
    return server, port
