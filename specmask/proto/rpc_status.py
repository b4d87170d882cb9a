"""Machine-readable error details on every SpecMask gRPC error (google.rpc.Status).

The status code says what kind of failure it is; the details say why, in a form
a client can branch on without parsing the message:

* ``ErrorInfo``: ``reason`` (UPPER_SNAKE, stable), ``domain`` = ``DOMAIN``, and
  string metadata;
* ``BadRequest``: the request field at fault, for INVALID_ARGUMENT;
* ``RetryInfo``: how long to back off, for RESOURCE_EXHAUSTED (retrying later helps).

E.g. a grammar over the compile budget is INVALID_ARGUMENT with reason
``GRAMMAR_TOO_COMPLEX`` and field ``grammar``: retrying cannot help, so it is
never DEADLINE_EXCEEDED (which clients and routers retry or fail over).

Servers call ``status_for(code, message, ...)`` and abort with it; clients call
``details_of(rpc_error)``. The details travel in the ``grpc-status-details-bin``
trailer (grpcio-status); clients that ignore them still get code and message.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "specmask.dev"
DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class _Status(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


@dataclass(frozen=True)
class ErrorDetails:
    """What a client reads back (``details_of``); empty fields when the server sent none."""

    reason: str = ""
    domain: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    field_violations: tuple[tuple[str, str], ...] = ()  # (field, description)
    retry_after_s: float | None = None


def reason_from_class(exc: BaseException) -> str:
    """A stable reason from an exception class name: GrammarTooComplex -> GRAMMAR_TOO_COMPLEX."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).upper()


def status_for(
    code: grpc.StatusCode,
    message: str,
    *,
    reason: str,
    metadata: Mapping[str, str] | None = None,
    bad_fields: Sequence[tuple[str, str]] = (),
    retry_after_s: float | None = None,
    extra_trailers: Sequence[tuple[str, str]] = (),
) -> grpc.Status:
    """A grpc.Status carrying ErrorInfo (+ BadRequest, + RetryInfo) for ``context.abort_with_status``."""
    details = [error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=dict(metadata or {}))]
    if bad_fields:
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in bad_fields
                ]
            )
        )
    if retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(retry_after_s * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for d in details:
        anything = any_pb2.Any()
        anything.Pack(d)
        packed.append(anything)
    proto = status_pb2.Status(code=code.value[0], message=message, details=packed)
    status = rpc_status.to_status(proto)
    return _Status(status.code, status.details, (*status.trailing_metadata, *extra_trailers))


def details_of(error: grpc.RpcError) -> ErrorDetails:
    """The details a SpecMask server attached to ``error`` (ErrorDetails() if none)."""
    try:
        proto = rpc_status.from_call(error)
    except ValueError:  # a trailer that contradicts the call's own code/message
        return ErrorDetails()
    if proto is None:
        return ErrorDetails()
    out: dict = {}
    for anything in proto.details:
        info, bad, retry = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
        if anything.Unpack(info):
            out.update(reason=info.reason, domain=info.domain, metadata=dict(info.metadata))
        elif anything.Unpack(bad):
            out["field_violations"] = tuple((v.field, v.description) for v in bad.field_violations)
        elif anything.Unpack(retry):
            out["retry_after_s"] = retry.retry_delay.ToNanoseconds() / 1e9
    return ErrorDetails(**out)
