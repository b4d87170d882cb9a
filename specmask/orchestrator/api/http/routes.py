"""HTTP handlers: parse, translate, submit to the engine, answer (JSON or SSE). No generation logic.

Every request goes through ``Engine.submit`` like a gRPC one (same admission
bound, validation, batching) and ends with ``Engine.cancel`` in a ``finally``:
a no-op for a finished request, and the cancellation path when the client goes
away (aiohttp cancels the handler on disconnect, ``handler_cancellation=True``),
which frees the request's KV cache and mask session on its worker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from specmask.common import tracing
from specmask.common.tracing import NO_SPAN, Span
from specmask.gpu_worker.types import ErrorKind, FinishReason
from specmask.orchestrator import reasoning, request_trace
from specmask.orchestrator.api.http import responses as rsp
from specmask.orchestrator.api.http import streaming, translate
from specmask.orchestrator.api.http.errors import NOT_FOUND, ApiError
from specmask.orchestrator.api.http.input_checks import check_content_type, refuse_lone_surrogates
from specmask.orchestrator.api.http.lenient import UnknownFieldLog
from specmask.orchestrator.api.http.prompting import ChatPrompter
from specmask.orchestrator.api.http.protocol import ChatCompletionRequest, CompletionRequest
from specmask.orchestrator.client_identity import client_identity
from specmask.orchestrator.engine import Engine
from specmask.orchestrator.errors import RequestError
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.output_check import OutputChecker
from specmask.orchestrator.request import Request
from specmask.orchestrator.token_text import TokenTexts, VocabTokenizer
from specmask.orchestrator.types import GenerationRequest, GenerationResult
from specmask.orchestrator.validation import RequestValidator

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
TOO_DEEP = "request body nests too deeply"
_MAX_ERRORS_SHOWN = 5

Body = TypeVar("Body", bound=BaseModel)


async def parse_body(request: web.Request, model: type[Body]) -> Body:
    check_content_type(request)
    raw = await request.read()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError.invalid(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError.invalid(TOO_DEEP) from None
    if not isinstance(data, dict):
        raise ApiError.invalid("request body must be a JSON object")
    refuse_lone_surrogates(data)
    try:
        return model.model_validate(data, strict=True)
    except RecursionError:
        raise ApiError.invalid(TOO_DEEP) from None
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:_MAX_ERRORS_SHOWN]]
        more = f" (and {len(errors) - _MAX_ERRORS_SHOWN} more)" if len(errors) > _MAX_ERRORS_SHOWN else ""
        param = ".".join(str(p) for p in errors[0]["loc"]) if errors and errors[0]["loc"] else None
        raise ApiError.invalid("invalid request: " + "; ".join(parts) + more, param=param) from None


class OpenAIRoutes:
    def __init__(
        self,
        engine: Engine,
        metrics: OrchestratorMetrics,
        prompter: ChatPrompter,
        *,
        model_name: str,
        max_model_len: int,
        ready: Callable[[], bool] | None = None,
        tokenizer: VocabTokenizer | None = None,
        reasoning_parser: reasoning.ReasoningParser | None = None,
    ) -> None:
        """``ready``: readiness as gRPC health reports it (None: the engine's worker health alone).
        ``reasoning_parser``: chat outputs start with the model's thinking in this format (reasoning.py).
        ``tokenizer``: the target's, for the token strings and bytes of logprobs (None: logprobs
        are refused)."""
        self._engine = engine
        self._ready = ready if ready is not None else (lambda: engine.healthy)
        self._metrics = metrics
        self._prompter = prompter
        self._model = model_name
        self._max_model_len = max_model_len
        self._created = int(time.time())
        self._checker = OutputChecker()  # tool calls' arguments against their own tool's schema
        self._unknown = UnknownFieldLog(metrics.http_unknown_fields)
        self._tokenizer = tokenizer
        self._token_texts: TokenTexts | None = None  # built on the first logprobs request
        self._reasoning_parser = reasoning_parser

    def _texts(self, translated: translate.Translated) -> TokenTexts | None:
        """The token texts for a request with logprobs (None: it asked for none)."""
        if translated.request.sampling.logprobs is None:
            return None
        if self._token_texts is None:
            if self._tokenizer is None:
                raise ApiError.invalid("logprobs are not available: this server has no tokenizer", param="logprobs")
            self._token_texts = TokenTexts(self._tokenizer)
        return self._token_texts

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_get("/health", self.health)

    # ---- metadata --------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self._model,
            "object": "model",
            "created": self._created,
            "owned_by": "specmask",
            "max_model_len": self._max_model_len,
        }

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return web.json_response(self._model_card())

    async def health(self, request: web.Request) -> web.Response:
        """Readiness, the same state as gRPC health: 200 while a GPU worker is healthy and a mask
        replica answers, 503 otherwise (docs/api-errors.md)."""
        if self._ready():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable"}, status=503)

    def _check_model(self, name: str) -> None:
        if name != self._model:
            raise ApiError(NOT_FOUND, f"model {name!r} does not exist; this server serves {self._model!r}")

    # ---- generation ------------------------------------------------------

    def _request_id(self, request: web.Request) -> str:
        try:
            return RequestValidator.request_id(request.headers.get(REQUEST_ID_HEADER, ""))
        except RequestError as exc:
            raise ApiError.invalid(f"{REQUEST_ID_HEADER}: {exc.message}") from None

    def _request_span(self, http: web.Request, req: GenerationRequest) -> Span:
        """The request's span, continuing the caller's traceparent (NO_SPAN while tracing is off)."""
        if not tracing.enabled():
            return NO_SPAN
        resource = http.match_info.route.resource
        route = resource.canonical if resource is not None else http.path
        attributes = {"http.request.method": http.method, "http.route": route}
        return request_trace.start_request(f"{http.method} {route}", http.headers, req, self._model, attributes)

    async def _submit(self, translated: translate.Translated, http: web.Request) -> Request:
        # The end client, for the mask service's per-owner compile fairness.
        client = client_identity(http.headers.items(), http.remote or "")
        span = self._request_span(http, translated.request)
        try:
            with request_trace.admission(span):
                admitted = await self._engine.submit(dataclasses.replace(translated.request, client=client))
            request_trace.attach(span, admitted)
            return admitted
        except RequestError as exc:
            self._metrics.rejected.labels(code=exc.code.name).inc()
            logger.info("[request_id=%s] refused (%s): %s", translated.request.request_id, exc.code.name, exc.message)
            raise ApiError.from_request_error(exc) from None

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await parse_body(request, ChatCompletionRequest)
        self._check_model(body.model)
        request_id = self._request_id(request)
        self._unknown.note(body, request_id)
        translated = _guard_depth(translate.chat_request, body, request_id, self._prompter)
        thinking = reasoning.format_for(
            self._reasoning_parser, body.chat_template_kwargs, self._prompter.template_variables
        )
        try:
            sectioned = reasoning.with_section(translated.request, thinking, body.max_reasoning_tokens)
        except ValueError as exc:
            raise ApiError.invalid(str(exc), param="max_reasoning_tokens") from None
        translated = dataclasses.replace(translated, request=sectioned)
        texts = self._texts(translated)
        admitted = await self._submit(translated, request)
        env = rsp.Envelope(id=f"chatcmpl-{request_id}", model=self._model)
        headers = {REQUEST_ID_HEADER: request_id}
        try:
            if body.stream:
                include_usage = body.stream_options is not None and body.stream_options.include_usage
                return await streaming.stream_chat(
                    request,
                    admitted,
                    env,
                    headers,
                    calls=translated.tools,
                    checker=self._checker,
                    include_usage=include_usage,
                    texts=texts,
                    thinking=thinking,
                )
            result = await admitted.result()
            _raise_for_finish(result.finish_reason, result.error, result.error_kind)
            output_chars = len(result.text)  # the whole output's, which logprob offsets count in
            answer = reasoning.split_answer(thinking, result.text) if thinking is not None else None
            if answer is not None:  # the grammar, and every check, governed only the content
                result = dataclasses.replace(result, text=answer.content or "")
            message, finish = rsp.chat_message(result.text, result.finish_reason, translated.tools, self._checker)
            if answer is not None:
                message = rsp.with_reasoning(message, answer.reasoning, answer.content is None)
            logprobs = None
            if texts is not None:
                # Tool calls are not content: their tokens have no content logprobs (OpenAI's shape).
                entries = result.logprobs if message.get("content") is not None else None
                if entries is not None and message.get("tool_calls"):  # text, then calls
                    calls_at = output_chars - (len(result.text) - len(message["content"]))
                    entries = tuple(e for e in entries if e.text_offset < calls_at)
                logprobs = rsp.chat_logprobs(entries, texts)
            return web.json_response(
                rsp.chat_completion(env, message, finish, result.usage, result.grammar, logprobs), headers=headers
            )
        finally:
            self._engine.cancel(admitted.request_id)
            request_trace.finish(admitted)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await parse_body(request, CompletionRequest)
        self._check_model(body.model)
        request_id = self._request_id(request)
        self._unknown.note(body, request_id)
        translated = _guard_depth(translate.completion_request, body, request_id)
        texts = self._texts(translated)
        admitted = await self._submit(translated, request)
        env = rsp.Envelope(id=f"cmpl-{request_id}", model=self._model)
        headers = {REQUEST_ID_HEADER: request_id}
        try:
            if body.stream:
                include_usage = body.stream_options is not None and body.stream_options.include_usage
                return await streaming.stream_completion(
                    request, admitted, env, headers, include_usage=include_usage, texts=texts
                )
            result: GenerationResult = await admitted.result()
            _raise_for_finish(result.finish_reason, result.error, result.error_kind)
            finish = rsp.FINISH_REASONS[result.finish_reason]
            logprobs = None if texts is None else rsp.completion_logprobs(result.logprobs or (), texts)
            return web.json_response(
                rsp.completion(env, result.text, finish, result.usage, result.grammar, logprobs), headers=headers
            )
        finally:
            self._engine.cancel(admitted.request_id)
            request_trace.finish(admitted)


def _guard_depth(translate_fn: Callable[..., translate.Translated], *args: Any) -> translate.Translated:
    """Translation serialises schemas again; a body nested near the recursion limit is a 400."""
    try:
        return translate_fn(*args)
    except RecursionError:
        raise ApiError.invalid(TOO_DEEP) from None


def _raise_for_finish(reason: FinishReason, error: str | None, kind: ErrorKind | None) -> None:
    exc = rsp.finish_error(reason, error, kind)
    if exc is not None:
        raise exc
