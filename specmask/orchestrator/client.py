"""Client for the orchestrator's gRPC API (used by `specmask generate`, the demo, bench, tests).

Importable with grpcio and protobuf alone (`pip install specmask[client]`): no
torch, xgrammar, numpy or Ray. ``OrchestratorClient`` is synchronous,
``AsyncOrchestratorClient`` the grpc.aio twin; both take ``tls=True`` (system
roots, or ``root_certificates`` PEM; ``private_key``/``certificate_chain`` for
mutual TLS) and ``options`` (gRPC channel options, e.g.
``("grpc.ssl_target_name_override", "name")``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2_grpc as pb_grpc

FINISH_REASON_NAMES: dict[int, str] = {
    value: name.removeprefix("FINISH_REASON_").lower() for name, value in pb.FinishReason.items()
}


def build_request(
    prompt: str | Sequence[int] | Sequence[Mapping[str, str]],
    *,
    schema: Any = None,
    regex: str | None = None,
    any_json: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    max_tokens: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    speculation: bool | None = None,
    k: int | None = None,
    draft_masking: bool | None = None,
    request_id: str = "",
    schema_instruction: str | None = None,
    logprobs: int | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest; ``schema`` may be a dict or JSON text. Unset options keep server defaults.

    ``prompt``: text, token ids, or chat messages ``[{"role": ..., "content": ...}, ...]`` (rendered
    server-side with the model's chat template; ``schema_instruction`` overrides the default
    instruction that puts a JSON Schema into the conversation, "" = none). ``logprobs``: each
    returned token's log-probability plus that many alternatives (0..20; None = none)."""
    req = pb.GenerateRequest(request_id=request_id)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)  # type: ignore[index]  # prompt[0] is a Mapping: chat turns
        if schema_instruction is not None:
            req.chat.schema_instruction = schema_instruction
    else:
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]  # neither text nor turns: token ids
    if schema is not None:
        req.grammar.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
    elif regex is not None:
        req.grammar.regex = regex
    elif any_json:
        req.grammar.any_json.SetInParent()
    s = req.sampling
    for name, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
        ("max_tokens", max_tokens),
        ("logprobs", logprobs),
    ):
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(stop)
    s.ignore_eos = ignore_eos
    if speculation is not None:
        req.speculation.enabled = speculation
    if k is not None:
        req.speculation.k = k
    if draft_masking is not None:
        req.speculation.draft_masking = draft_masking
    return req


@dataclass
class StreamedResult:
    """A stream folded back into one result, plus the deltas as they came."""

    request_id: str = ""
    text_deltas: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    error: str = ""
    usage: pb.Usage | None = None
    # A reasoning model's thinking (GenerateStreamResponse.reasoning_text), sent before the text.
    reasoning_deltas: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_deltas)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning_deltas)

    @property
    def finish_reason_name(self) -> str:
        return FINISH_REASON_NAMES.get(self.finish_reason, str(self.finish_reason))

    def add(self, chunk: pb.GenerateStreamResponse) -> None:
        self.request_id = chunk.request_id
        self.text_deltas.append(chunk.text)
        self.reasoning_deltas.append(chunk.reasoning_text)
        self.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = chunk.finish_reason
            self.error = chunk.error
            self.usage = chunk.usage


@dataclass(frozen=True)
class ChannelSecurity:
    """TLS settings of a channel; ``tls=False`` is plaintext (loopback, in-cluster)."""

    tls: bool = False
    root_certificates: bytes | None = None  # PEM; None = the system's roots
    private_key: bytes | None = None  # PEM, with certificate_chain: mutual TLS
    certificate_chain: bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)

    def open_channel(self, api: Any, address: str, options: Sequence[tuple[str, Any]]) -> Any:
        """A channel from ``api`` (``grpc`` or ``grpc.aio``: same factory names), secure when asked."""
        if self.tls:
            return api.secure_channel(address, self.credentials(), options=list(options))
        return api.insecure_channel(address, options=list(options))


class OrchestratorClient:
    """A small synchronous client (one channel)."""

    def __init__(
        self,
        address: str,
        *,
        tls: bool = False,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.address = address
        security = ChannelSecurity(tls, root_certificates, private_key, certificate_chain)
        self._channel = security.open_channel(grpc, address, options)
        self.stub = pb_grpc.OrchestratorServiceStub(self._channel)

    def generate(self, req: pb.GenerateRequest, *, timeout_s: float = 120.0) -> pb.GenerateResponse:
        return self.stub.Generate(req, timeout=timeout_s)

    def generate_retrying_overload(self, req: pb.GenerateRequest, *, timeout_s: float = 120.0) -> pb.GenerateResponse:
        """``generate``, retried with backoff while the server answers RESOURCE_EXHAUSTED (admission or
        compile queue full: nothing ran); any other error propagates."""
        delay = OVERLOAD_RETRY_FIRST_S
        for attempt in range(OVERLOAD_RETRY_ATTEMPTS):
            try:
                return self.generate(req, timeout_s=timeout_s)
            except grpc.RpcError as exc:
                if attempt == OVERLOAD_RETRY_ATTEMPTS - 1 or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
            time.sleep(delay)
            delay = min(2 * delay, OVERLOAD_RETRY_MAX_S)
        raise AssertionError("unreachable")

    def stream(self, req: pb.GenerateRequest, *, timeout_s: float = 120.0) -> Iterator[pb.GenerateStreamResponse]:
        return self.stub.GenerateStream(req, timeout=timeout_s)

    def stream_all(self, req: pb.GenerateRequest, *, timeout_s: float = 120.0) -> StreamedResult:
        result = StreamedResult()
        for chunk in self.stream(req, timeout_s=timeout_s):
            result.add(chunk)
        return result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> OrchestratorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncOrchestratorClient:
    """The asyncio client (grpc.aio); create and use it on one event loop."""

    def __init__(
        self,
        address: str,
        *,
        tls: bool = False,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.address = address
        security = ChannelSecurity(tls, root_certificates, private_key, certificate_chain)
        self._channel = security.open_channel(grpc.aio, address, options)
        self.stub = pb_grpc.OrchestratorServiceStub(self._channel)

    async def generate(self, req: pb.GenerateRequest, *, timeout_s: float = 120.0) -> pb.GenerateResponse:
        return await self.stub.Generate(req, timeout=timeout_s)

    async def stream(
        self, req: pb.GenerateRequest, *, timeout_s: float = 120.0
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        call = self.stub.GenerateStream(req, timeout=timeout_s)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()  # a no-op once the stream ended; cancels it when the caller stops early

    async def stream_all(self, req: pb.GenerateRequest, *, timeout_s: float = 120.0) -> StreamedResult:
        result = StreamedResult()
        async for chunk in self.stream(req, timeout_s=timeout_s):
            result.add(chunk)
        return result

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncOrchestratorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# Overload (RESOURCE_EXHAUSTED: admission queue full, mask service busy compiling) arrives
# before any output and says "retry shortly"; demo and benchmarks retry it like a client should.
OVERLOAD_RETRY_ATTEMPTS = 8
OVERLOAD_RETRY_FIRST_S = 1.0
OVERLOAD_RETRY_MAX_S = 8.0


async def stream_retrying_overload(
    stub: pb_grpc.OrchestratorServiceStub, req: pb.GenerateRequest, *, timeout: float
) -> AsyncIterator[pb.GenerateStreamResponse]:
    """``stub.GenerateStream(req)``, retried with backoff while the server answers RESOURCE_EXHAUSTED
    before the first chunk; any other error, or one after output began, propagates."""
    import asyncio

    delay = OVERLOAD_RETRY_FIRST_S
    for attempt in range(OVERLOAD_RETRY_ATTEMPTS):
        started = False
        try:
            async for chunk in stub.GenerateStream(req, timeout=timeout):
                started = True
                yield chunk
            return
        except grpc.aio.AioRpcError as exc:
            last = attempt == OVERLOAD_RETRY_ATTEMPTS - 1
            if started or last or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
        await asyncio.sleep(delay)
        delay = min(2 * delay, OVERLOAD_RETRY_MAX_S)
