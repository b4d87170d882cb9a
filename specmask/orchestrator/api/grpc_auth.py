"""API-key authentication of the orchestrator's gRPC API (grpc.aio server interceptor).

With keys configured (orchestrator.auth_keys), every OrchestratorService call
must carry ``authorization: Bearer <key>`` metadata (or ``x-api-key``), else it
ends with UNAUTHENTICATED before it reaches the servicer; health and reflection
stay open (probes carry no key).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from specmask.orchestrator.auth_keys import ApiKeys, presented_key

_MISSING = "missing API key: send 'authorization: Bearer <key>' metadata"
_WRONG = "incorrect API key"


def _deny_like(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that ends the call with UNAUTHENTICATED."""

    async def unary(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(_request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield None  # pragma: no cover - abort raises

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to ``protected_prefix`` methods without one of ``keys`` (UNAUTHENTICATED)."""

    def __init__(self, keys: ApiKeys, protected_prefix: str) -> None:
        if not keys.enabled:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._keys = keys
        self._prefix = protected_prefix

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        metadata = [
            (str(k), v if isinstance(v, str) else v.decode(errors="replace"))
            for k, v in details.invocation_metadata or ()
        ]
        key = presented_key(metadata)
        if self._keys.accepts(key):
            return handler
        return _deny_like(handler, _WRONG if key else _MISSING)
