"""Typed errors of the orchestrator, each bound to one gRPC status.

Domain code (validation, admission, engine) raises these; each class names its
``grpc.StatusCode``, which the gRPC API ends the call with, and the error table
(api/error_table.py) says what the HTTP API answers for it, so a client never
sees a traceback.
"""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A request refused before generation; ``code`` says which status the client gets."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retry_after_s: float | None = None  # RetryInfo for RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, reason: str = "", field: str = "") -> None:
        """``reason``: the google.rpc.ErrorInfo reason (default: from the class name,
        specmask/proto/rpc_status.py); ``field``: the request field at fault (BadRequest)."""
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.field = field


class InvalidRequest(RequestError):
    """Bad prompt, sampling or speculation parameters, or a grammar the mask service refuses."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DuplicateRequestId(RequestError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Overloaded(RequestError):
    """The admission queue is full: the client should back off and retry."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after_s = 1.0


class Unavailable(RequestError):
    """No healthy worker, or the mask service could not be reached to validate a grammar."""

    code = grpc.StatusCode.UNAVAILABLE


class GrammarTimeout(RequestError):
    """The grammar engine did not finish compiling in time (too large or too complex)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ShuttingDown(Unavailable):
    pass
