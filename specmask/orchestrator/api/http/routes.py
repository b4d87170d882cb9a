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
from specmask.orchestrator.api.http import tool_grammar, translate
from specmask.orchestrator.api.http.errors import GRAMMAR_VIOLATION, NOT_FOUND, ApiError
from specmask.orchestrator.api.http.input_checks import check_content_type, refuse_lone_surrogates
from specmask.orchestrator.api.http.lenient import UnknownFieldLog
from specmask.orchestrator.api.http.prompting import ChatPrompter
from specmask.orchestrator.api.http.protocol import ChatCompletionRequest, CompletionRequest
from specmask.orchestrator.api.http.sse import DeltaEncoder, EventStream
from specmask.orchestrator.client_identity import client_identity
from specmask.orchestrator.engine import Engine
from specmask.orchestrator.errors import RequestError
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.output_check import OutputChecker
from specmask.orchestrator.request import Request
from specmask.orchestrator.token_text import TokenTexts, VocabTokenizer
from specmask.orchestrator.types import (
    GenerationRequest,
    GenerationResult,
    GrammarReport,
    OutputLogprob,
    RequestOutput,
    Usage,
)
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
                return await self._stream_chat(
                    request, admitted, env, headers, translated, include_usage, texts, thinking
                )
            result = await admitted.result()
            _raise_for_finish(result.finish_reason, result.error, result.error_kind)
            output_chars = len(result.text)  # the whole output's, which logprob offsets count in
            answer = reasoning.split_answer(thinking, result.text) if thinking is not None else None
            if answer is not None:  # the grammar, and every check, governed only the content
                result = dataclasses.replace(result, text=answer.content or "")
            message, finish = self._chat_message(result.text, result.finish_reason, translated.tools)
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
                return await self._stream_completion(request, admitted, env, headers, include_usage, texts)
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

    def _chat_message(
        self, text: str, reason: FinishReason, calls: tool_grammar.ToolGrammar | None
    ) -> tuple[dict[str, Any], str]:
        """The assistant message and finish_reason of a successful finish.

        With tools, complete calls are ``tool_calls``, each checked against its tool's schema
        (a failure is an error, never a success); text (tool_choice "auto") is content. Calls
        cut short (length, stop string) are plain content with that finish reason.
        """
        if calls is None:
            return {"role": "assistant", "content": text}, rsp.FINISH_REASONS[reason]
        before, call_text = tool_grammar.split_calls(text, calls)
        if reason is FinishReason.GRAMMAR_COMPLETE and call_text is not None:
            try:
                parsed = tool_grammar.parse_calls(call_text, calls, self._checker)
            except ValueError as exc:
                raise ApiError(
                    GRAMMAR_VIOLATION, f"grammar violation: the generated tool call is not valid: {exc}"
                ) from None
            # Text before the calls is their content, as vLLM's parsers return it ("Let me check."),
            # whitespace too: the same text a stream has sent as content deltas.
            content = before or None
            return {"role": "assistant", "content": content, "tool_calls": parsed}, "tool_calls"
        return {"role": "assistant", "content": tool_grammar.text_content(text, calls)}, rsp.FINISH_REASONS[reason]

    # ---- streaming -------------------------------------------------------

    async def _stream_chat(
        self,
        request: web.Request,
        admitted: Request,
        env: rsp.Envelope,
        headers: dict[str, str],
        translated: translate.Translated,
        include_usage: bool,
        texts: TokenTexts | None = None,
        thinking: reasoning.ReasoningFormat | None = None,
    ) -> web.StreamResponse:
        """``texts``: the request asked for logprobs; each text chunk then carries its tokens'.
        ``thinking``: the output starts with reasoning, streamed as its own deltas first."""
        stream = await EventStream.open(request, headers)
        deltas = DeltaEncoder(rsp.chat_chunk(env, {"content": DeltaEncoder.PLACEHOLDER}))
        sections = reasoning.ReasoningStream(thinking) if thinking is not None else None
        calls = translated.tools
        # Tool calls are sent once complete and checked; text is streamed (its start is held
        # while it could still begin a call).
        split = tool_grammar.StreamSplit(calls)
        try:
            await stream.send(rsp.chat_chunk(env, {"role": "assistant", "content": ""}))
            held: list[str] = []
            held_logprobs: list[OutputLogprob] = []
            output_chars = 0  # the whole output's so far, which logprob offsets count in
            async for out in admitted.events():
                output_chars += len(out.text)
                if sections is not None:  # what follows sees only the content
                    out = await self._send_reasoning(stream, env, sections, out, texts)
                content, call_text = split.feed(out.text) if out.text else ("", "")
                if call_text:
                    held.append(call_text)
                if content and call_text:  # text, then the calls' start: each its tokens
                    tokens = [*held_logprobs, *(out.logprobs or ())]
                    calls_at = output_chars - len(call_text)
                    held_logprobs = [e for e in tokens if e.text_offset >= calls_at]
                    lp = (
                        None
                        if texts is None
                        else rsp.chat_logprobs([e for e in tokens if e.text_offset < calls_at], texts)
                    )
                    await stream.send(rsp.chat_chunk(env, {"content": content}, logprobs=lp))
                elif split.calls or (out.text and not content):
                    held_logprobs.extend(out.logprobs or ())  # held text's tokens (or tokens after it)
                elif texts is not None and (content or out.logprobs):
                    tokens, held_logprobs = [*held_logprobs, *(out.logprobs or ())], []
                    if split.holding:  # an end that may begin a call keeps its tokens back with it
                        held_from = output_chars - split.holding
                        held_logprobs = [e for e in tokens if e.text_offset >= held_from]
                        tokens = [e for e in tokens if e.text_offset < held_from]
                    lp = rsp.chat_logprobs(tokens, texts)
                    await stream.send(rsp.chat_chunk(env, {"content": content}, logprobs=lp))
                elif content:
                    await stream.send_raw(deltas.encode(content))
                if not out.finished:
                    continue
                assert out.finish_reason is not None and out.usage is not None
                error = rsp.finish_error(out.finish_reason, out.error, out.error_kind)
                if error is not None:
                    await stream.error(error)
                    return stream.response
                if split.calls:
                    try:
                        message, finish = self._chat_message("".join(held), out.finish_reason, calls)
                    except ApiError as exc:
                        await stream.error(exc)
                        return stream.response
                    await self._send_calls(stream, env, message, held_logprobs, texts)
                else:
                    finish = rsp.FINISH_REASONS[out.finish_reason]
                    pending = split.pending()  # a start that never became either branch: text
                    if pending or (texts is not None and held_logprobs):
                        last = None if texts is None else rsp.chat_logprobs(held_logprobs, texts)
                        await stream.send(rsp.chat_chunk(env, {"content": pending}, logprobs=last))
                await stream.send(rsp.chat_chunk(env, {}, finish))
                await self._finish_stream(stream, env, "chat.completion.chunk", out.usage, include_usage, out.grammar)
        except ConnectionResetError:
            logger.info("[request_id=%s] client went away mid-stream", admitted.request_id)
        return stream.response

    @staticmethod
    async def _send_reasoning(
        stream: EventStream,
        env: rsp.Envelope,
        sections: reasoning.ReasoningStream,
        out: RequestOutput,
        texts: TokenTexts | None,
    ) -> RequestOutput:
        """Send the event's reasoning as a reasoning delta; return the event holding only its content.
        Its tokens' logprobs go with the reasoning delta when it has no content, else with the content."""
        thought, content = sections.feed(out.text)
        if out.finished:
            more_thought, more_content = sections.finish()
            thought, content = thought + more_thought, content + more_content
        if thought:
            logprobs = None
            if texts is not None and not content:
                logprobs, out = rsp.chat_logprobs(out.logprobs or (), texts), dataclasses.replace(out, logprobs=None)
            await stream.send(rsp.chat_chunk(env, rsp.reasoning_delta(thought), logprobs=logprobs))
        return dataclasses.replace(out, text=content)

    @staticmethod
    async def _send_calls(
        stream: EventStream,
        env: rsp.Envelope,
        message: dict[str, Any],
        held_logprobs: list[OutputLogprob],
        texts: TokenTexts | None,
    ) -> None:
        """The held output's deltas, as vLLM streams calls: per call, one delta with its id and
        name, then one with its arguments; or content, when the calls were cut short."""
        calls = message.get("tool_calls")
        if not calls:
            lp = None if texts is None else rsp.chat_logprobs(held_logprobs, texts)
            await stream.send(rsp.chat_chunk(env, {"content": message["content"]}, logprobs=lp))
            return
        # Tool calls are not content: their tokens have no content logprobs (OpenAI's shape).
        no_content = None if texts is None else rsp.chat_logprobs(None, texts)
        for i, call in enumerate(calls):
            head = {"index": i, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"]}}
            await stream.send(rsp.chat_chunk(env, {"tool_calls": [head]}, logprobs=no_content if i == 0 else None))
            arguments = {"index": i, "function": {"arguments": call["function"]["arguments"]}}
            await stream.send(rsp.chat_chunk(env, {"tool_calls": [arguments]}))

    async def _stream_completion(
        self,
        request: web.Request,
        admitted: Request,
        env: rsp.Envelope,
        headers: dict[str, str],
        include_usage: bool,
        texts: TokenTexts | None = None,
    ) -> web.StreamResponse:
        """``texts``: the request asked for logprobs; each chunk then carries its tokens'."""
        stream = await EventStream.open(request, headers)
        deltas = DeltaEncoder(rsp.completion_chunk(env, DeltaEncoder.PLACEHOLDER))
        try:
            async for out in admitted.events():
                lp = None if texts is None else rsp.completion_logprobs(out.logprobs or (), texts)
                if out.finished:
                    assert out.finish_reason is not None and out.usage is not None
                    error = rsp.finish_error(out.finish_reason, out.error, out.error_kind)
                    if error is not None:
                        await stream.error(error)
                        return stream.response
                    finish = rsp.FINISH_REASONS[out.finish_reason]
                    await stream.send(rsp.completion_chunk(env, out.text, finish, logprobs=lp))
                    await self._finish_stream(stream, env, "text_completion", out.usage, include_usage, out.grammar)
                elif texts is not None and (out.text or out.logprobs):
                    await stream.send(rsp.completion_chunk(env, out.text, logprobs=lp))
                elif out.text:
                    await stream.send_raw(deltas.encode(out.text))
        except ConnectionResetError:
            logger.info("[request_id=%s] client went away mid-stream", admitted.request_id)
        return stream.response

    @staticmethod
    async def _finish_stream(
        stream: EventStream,
        env: rsp.Envelope,
        obj: str,
        usage: Usage,
        include: bool,
        grammar: GrammarReport | None = None,
    ) -> None:
        if include:
            await stream.send(rsp.usage_chunk(env, obj, usage, grammar))
        await stream.done()


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
