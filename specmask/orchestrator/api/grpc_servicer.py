"""gRPC servicer: proto <-> domain translation and errors to statuses (by the error table,
api/error_table.py), nothing else.

Request messages arrive as bytes and are decoded here, so a malformed message
gets INVALID_ARGUMENT (gRPC's own deserializer would answer UNKNOWN); the
handlers are registered by ``add_to_server`` for that reason.

Cancellation: grpc.aio cancels the handler task when the client cancels the
RPC or its deadline expires; the handler then cancels the request in the
engine, which frees its KV cache and mask session on the worker.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from specmask.common import tracing
from specmask.common.tracing import NO_SPAN, Span
from specmask.orchestrator import convert, request_trace
from specmask.orchestrator.api.grpc_reasoning import GrpcReasoning, StreamReasoning, split_reply
from specmask.orchestrator.client_identity import client_identity
from specmask.orchestrator.engine import Engine
from specmask.orchestrator.errors import RequestError
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.reasoning import ReasoningFormat
from specmask.orchestrator.request import Request
from specmask.orchestrator.types import GenerationRequest
from specmask.orchestrator.validation import RequestValidator
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from specmask.proto.rpc_status import reason_from_class, status_for

logger = logging.getLogger(__name__)

_SERVICE = pb.DESCRIPTOR.services_by_name["OrchestratorService"].full_name


class OrchestratorServicer:
    def __init__(
        self,
        engine: Engine,
        metrics: OrchestratorMetrics,
        *,
        model_name: str = "",
        reasoning: GrpcReasoning | None = None,
    ) -> None:
        """``model_name``: the served model's id, named on the requests' trace spans.
        ``reasoning``: chat outputs start with the model's thinking (api/grpc_reasoning.py)."""
        self._engine = engine
        self._metrics = metrics
        self._model_name = model_name
        self._reasoning = reasoning if reasoning is not None else GrpcReasoning()

    async def _decode(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.GenerateRequest:
        try:
            return pb.GenerateRequest.FromString(raw)
        except DecodeError:
            self._metrics.rejected.labels(code=grpc.StatusCode.INVALID_ARGUMENT.name).inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed GenerateRequest message")
            raise  # unreachable: abort raises

    def _request_span(self, req: GenerationRequest, context: grpc.aio.ServicerContext, method: str) -> Span:
        """The request's span, continuing the traceparent in the call's metadata (NO_SPAN while
        tracing is off)."""
        if not tracing.enabled():
            return NO_SPAN
        attributes = {"rpc.system": "grpc", "rpc.service": _SERVICE, "rpc.method": method}
        metadata = context.invocation_metadata()
        return request_trace.start_request(f"{_SERVICE}/{method}", metadata, req, self._model_name, attributes)

    async def _admit(
        self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext, method: str
    ) -> tuple[Request, ReasoningFormat | None]:
        """The admitted request, and the reasoning format its output is read in (None: none)."""
        try:
            request_id = RequestValidator.request_id(msg.request_id)
            req, thinking = self._reasoning.sectioned(msg, convert.request_from_proto(msg, request_id))
            # The end client, for the mask service's per-owner compile fairness.
            client = client_identity(context.invocation_metadata() or (), context.peer() or "")
            span = self._request_span(req, context, method)
            with request_trace.admission(span):
                admitted = await self._engine.submit(dataclasses.replace(req, client=client))
            request_trace.attach(span, admitted)
            return admitted, thinking
        except RequestError as exc:
            self._metrics.rejected.labels(code=exc.code.name).inc()
            logger.info("[request_id=%s] refused (%s): %s", msg.request_id or "-", exc.code.name, exc.message)
            status = status_for(
                exc.code,  # the status the error names (api/error_table.py: refusals)
                exc.message,
                reason=exc.reason or reason_from_class(exc),
                bad_fields=((exc.field, exc.message),) if exc.field else (),
                retry_after_s=exc.retry_after_s if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED else None,
            )
            await context.abort(status.code, status.details, status.trailing_metadata)
            raise  # unreachable: abort raises
        except Exception:
            # A bug, not the client's fault: log it here, never send a traceback.
            logger.exception("[request_id=%s] admission failed", msg.request_id or "-")
            self._metrics.rejected.labels(code=grpc.StatusCode.INTERNAL.name).inc()
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")
            raise

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        admitted, thinking = await self._admit(await self._decode(raw, context), context, "Generate")
        try:
            return split_reply(convert.result_to_proto(await admitted.result()), thinking)
        finally:
            # A no-op for finished requests; frees worker state after a client
            # cancel or deadline (CancelledError lands here).
            self._engine.cancel(admitted.request_id)
            request_trace.finish(admitted)

    async def GenerateStream(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        admitted, thinking = await self._admit(await self._decode(raw, context), context, "GenerateStream")
        sections = StreamReasoning(thinking)
        try:
            async for out in admitted.events():
                yield sections.split(out, convert.output_to_proto(out))
        finally:
            self._engine.cancel(admitted.request_id)
            request_trace.finish(admitted)


def add_to_server(servicer: OrchestratorServicer, server: grpc.aio.Server, service_name: str) -> None:
    """Register the API like the generated ``add_OrchestratorServiceServicer_to_server``, minus request decoding."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, response_serializer=pb.GenerateResponse.SerializeToString
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, response_serializer=pb.GenerateStreamResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
