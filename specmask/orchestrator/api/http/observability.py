"""What an operator used to vLLM expects of the HTTP port: ``/metrics``, ``/version``,
``/tokenize``, one access-log line per request and requests counted by HTTP status.

* ``/metrics``: the orchestrator's Prometheus registry (the same series as the
  ``--metrics-port`` endpoint, which stays), including the ``vllm:*`` names.
* Access log: one line per request on the ``orchestrator.api.http.access`` logger
  (method, path, status, seconds, request id, client address), 4xx and 5xx
  included, written after the response (for a stream: after its last event).
* ``specmask_http_requests_total{route, status}``: every request by its route
  pattern (not the raw path, so probes of random URLs cannot grow the series) and
  final status; ``vllm:http_requests`` is not a vLLM name, so there is no twin.
* ``/version``: ``{"version": ...}`` of the installed package.
* ``/tokenize``: vLLM's shape: ``{"model", "prompt"}`` or ``{"model", "messages"}``
  -> ``{"count", "max_model_len", "tokens"}``; messages are rendered with the chat
  template exactly as a chat request is (tools and the schema instruction aside).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from pydantic import Field

from specmask.orchestrator.api.http.errors import ApiError
from specmask.orchestrator.api.http.prompting import ChatPrompter
from specmask.orchestrator.api.http.protocol import ChatMessage, _Body
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.validation import MAX_CHARS_PER_TOKEN, Tokenizer

access_logger = logging.getLogger("specmask.orchestrator.api.http.access")

UNMATCHED_ROUTE = "unmatched"


def package_version() -> str:
    try:
        return importlib.metadata.version("specmask")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def access_log_middleware(counter: Counter) -> Middleware:
    """Outermost middleware: sees the final status, after errors became OpenAI error bodies."""

    @web.middleware
    async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away before an answer (nginx's code for it)
            raise
        finally:
            info = request.match_info.route.resource
            route = info.canonical if info is not None else UNMATCHED_ROUTE
            counter.labels(route=route, status=str(status)).inc()
            access_logger.info(
                '%s "%s %s" %d %.3fs request_id=%s',
                request.remote or "-",
                request.method,
                request.path[:256],
                status,
                time.perf_counter() - start,
                request.headers.get("X-Request-Id", "-")[:128],
            )

    return access_log


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's field; this server adds none either way


class ObservabilityRoutes:
    def __init__(
        self,
        metrics: OrchestratorMetrics,
        tokenizer: Tokenizer | None,
        prompter: ChatPrompter,
        model_name: str,
        max_model_len: int,
    ) -> None:
        self._metrics = metrics
        self._tokenizer = tokenizer
        self._prompter = prompter
        self._model = model_name
        self._max_model_len = max_model_len

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/version", self.version)
        if self._tokenizer is not None:
            app.router.add_post("/tokenize", self.tokenize)

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": package_version()})

    async def tokenize(self, request: web.Request) -> web.Response:
        from specmask.orchestrator.api.http.routes import parse_body

        body = await parse_body(request, TokenizeRequest)
        if body.model is not None and body.model != self._model:
            raise ApiError.invalid(f"model {body.model!r} is not served here; this server serves {self._model!r}")
        if (body.prompt is None) == (body.messages is None):
            raise ApiError.invalid("send exactly one of prompt and messages", param="prompt")
        text = body.prompt if body.prompt is not None else self._prompter.render(body.messages or [], None)
        if len(text) > MAX_CHARS_PER_TOKEN * self._max_model_len:
            raise ApiError.invalid(f"a text of {len(text)} characters is longer than the model's context")
        assert self._tokenizer is not None
        ids = await asyncio.to_thread(lambda: list(self._tokenizer.encode(text).ids))  # type: ignore[union-attr]  # lambda: no narrowing
        return web.json_response({"count": len(ids), "max_model_len": self._max_model_len, "tokens": ids})
