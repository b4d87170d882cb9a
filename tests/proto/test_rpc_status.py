"""specmask/proto/rpc_status.py round trip through a real gRPC server: ErrorInfo, BadRequest and
RetryInfo come back as sent, extra trailers survive, and plain errors read as no details."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from specmask.proto.rpc_status import DOMAIN, ErrorDetails, details_of, reason_from_class, status_for


class CompileQueueFull(Exception):
    pass


def _server(handler):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("t.T", {"M": grpc.unary_unary_rpc_method_handler(handler)}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _call(handler) -> grpc.RpcError:
    server, address = _server(handler)
    try:
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/t.T/M")(b"", timeout=10)
        return info.value
    finally:
        server.stop(0)


def test_round_trip_all_details() -> None:
    def handler(_req, context):
        context.abort_with_status(
            status_for(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "queue full",
                reason=reason_from_class(CompileQueueFull()),
                metadata={"queue": "compile"},
                bad_fields=(("grammar", "too big"),),
                retry_after_s=0.25,
                extra_trailers=(("retry-after-ms", "250"),),
            )
        )

    err = _call(handler)
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and err.details() == "queue full"
    assert details_of(err) == ErrorDetails(
        reason="COMPILE_QUEUE_FULL",
        domain=DOMAIN,
        metadata={"queue": "compile"},
        field_violations=(("grammar", "too big"),),
        retry_after_s=0.25,
    )
    assert ("retry-after-ms", "250") in tuple(err.trailing_metadata())


def test_plain_error_has_no_details() -> None:
    def handler(_req, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "plain")

    assert details_of(_call(handler)) == ErrorDetails()


def test_reason_from_class() -> None:
    class GrammarTooComplex(Exception):
        pass

    assert reason_from_class(GrammarTooComplex()) == "GRAMMAR_TOO_COMPLEX"
