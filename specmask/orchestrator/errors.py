"""Typed errors of the orchestrator, each bound to one gRPC status.

Domain code (validation, admission, engine) raises these; the servicer maps
them to status codes in one place, so a client never sees a traceback.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Mirrors the subset of grpc.StatusCode the API returns (names match)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"


class RequestError(Exception):
    """A request refused before generation; ``code`` says which status the client gets."""

    code: ErrorCode = ErrorCode.INTERNAL
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

    code = ErrorCode.INVALID_ARGUMENT


class DuplicateRequestId(RequestError):
    code = ErrorCode.ALREADY_EXISTS


class Overloaded(RequestError):
    """The admission queue is full: the client should back off and retry."""

    code = ErrorCode.RESOURCE_EXHAUSTED
    retry_after_s = 1.0


class Unavailable(RequestError):
    """No healthy worker, or the mask service could not be reached to validate a grammar."""

    code = ErrorCode.UNAVAILABLE


class GrammarTimeout(RequestError):
    """The grammar engine did not finish compiling in time (too large or too complex)."""

    code = ErrorCode.DEADLINE_EXCEEDED


class ShuttingDown(Unavailable):
    pass
