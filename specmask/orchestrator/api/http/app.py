"""The HTTP front door's lifecycle: an aiohttp application on the orchestrator's event loop.

aiohttp runs on the loop it is started from, the same loop as grpc.aio and the
engine's step loops, so handlers call the engine directly (no thread hops).
``handler_cancellation=True`` makes aiohttp cancel a handler whose client
disconnected; the handler's ``finally`` then cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from aiohttp import web
from aiohttp.typedefs import Middleware

from specmask.orchestrator.api.http.auth import api_key_middleware, enable_cors
from specmask.orchestrator.api.http.errors import INTERNAL, ApiError, HttpError
from specmask.orchestrator.api.http.observability import ObservabilityRoutes, access_log_middleware
from specmask.orchestrator.api.http.prompting import ChatPrompter, load_prompter
from specmask.orchestrator.api.http.routes import OpenAIRoutes
from specmask.orchestrator.auth_keys import ApiKeys
from specmask.orchestrator.config import OrchestratorConfig
from specmask.orchestrator.engine import Engine
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.reasoning import ReasoningParser
from specmask.orchestrator.token_text import VocabTokenizer
from specmask.orchestrator.validation import Tokenizer


class HttpTokenizer(Tokenizer, VocabTokenizer, Protocol):
    """What the HTTP API reads of the target's tokenizer (``tokenizers.Tokenizer``): encoding for
    /tokenize, the vocabulary for logprobs' token strings and bytes."""


logger = logging.getLogger(__name__)

# Same bound as the gRPC API's messages (server.MAX_MESSAGE_BYTES).
MAX_BODY_BYTES = 16 * 1024**2


@dataclass(frozen=True)
class HttpConfig:
    host: str
    port: int  # 0 = pick a free port
    model_name: str  # the one id /v1/models lists and requests must name
    max_model_len: int
    shutdown_grace_s: float = 5.0
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # () = open (orchestrator.auth_keys)
    cors_origins: tuple[str, ...] = ()  # () = no CORS headers


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure as an OpenAI error object; never a traceback."""
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers())
    except web.HTTPException as exc:  # routing (404, 405), body too large (413)
        if exc.status < 400:
            raise
        error = ApiError(HttpError(exc.status, "invalid_request_error"), exc.reason)
        return web.json_response(error.body(), status=exc.status)
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        return web.json_response(ApiError(INTERNAL, "internal error").body(), status=500)


class HttpFrontDoor:
    """``start()`` binds and serves; ``stop()`` stops accepting, lets handlers finish (bounded), closes."""

    def __init__(
        self,
        config: HttpConfig,
        engine: Engine,
        metrics: OrchestratorMetrics,
        prompter: ChatPrompter,
        tokenizer: HttpTokenizer | None = None,  # None: no /tokenize, no logprobs
        ready: Callable[[], bool] | None = None,
        reasoning_parser: ReasoningParser | None = None,
    ) -> None:
        """``ready``: the orchestrator's readiness (what gRPC health says); None = the engine's worker health."""
        self.config = config
        # The access log is outermost: it sees the final status of every request, errors included.
        middlewares: list[Middleware] = [
            access_log_middleware(metrics.http_requests),
            openai_errors,
            api_key_middleware(ApiKeys(config.api_keys)),
        ]
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        enable_cors(self.app, config.cors_origins)
        OpenAIRoutes(
            engine,
            metrics,
            prompter,
            model_name=config.model_name,
            max_model_len=config.max_model_len,
            ready=ready,
            tokenizer=tokenizer,
            reasoning_parser=reasoning_parser,
        ).add_to(self.app)
        ObservabilityRoutes(metrics, tokenizer, prompter, config.model_name, config.max_model_len).add_to(self.app)
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=config.shutdown_grace_s
        )
        self.port: int | None = None

    async def start(self) -> int:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        sockets = site._server.sockets if isinstance(site._server, asyncio.Server) else ()
        self.port = sockets[0].getsockname()[1] if sockets else self.config.port
        logger.info("OpenAI-compatible HTTP API on http://%s:%d/v1", self.config.host, self.port)
        return self.port

    async def stop(self) -> None:
        await self._runner.cleanup()


def front_door_for(
    config: OrchestratorConfig,
    engine: Engine,
    metrics: OrchestratorMetrics,
    max_model_len: int,
    tokenizer: HttpTokenizer | None = None,
    *,
    ready: Callable[[], bool] | None = None,
) -> HttpFrontDoor:
    """The HTTP API of an orchestrator built from ``config`` (``config.http_port`` set)."""
    assert config.http_port is not None
    http_config = HttpConfig(
        host=config.host,
        port=config.http_port,
        model_name=config.served_model_name or Path(config.target_dir).name,
        max_model_len=max_model_len,
        shutdown_grace_s=config.shutdown_grace_s,
        api_keys=config.api_keys,
        cors_origins=config.cors_origins,
    )
    return HttpFrontDoor(
        http_config,
        engine,
        metrics,
        load_prompter(config.target_dir, config.tool_call_parser),
        tokenizer,
        ready,
        config.reasoning_parser,
    )
