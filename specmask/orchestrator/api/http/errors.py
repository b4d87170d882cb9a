"""OpenAI-style error objects; which status each domain error gets is the error table's (api/error_table.py).

Every refusal a client can get from the HTTP API is an ``ApiError``; the app's
middleware turns it into ``{"error": {"message", "type", "param", "code"}}``
with its status, so no handler ever answers with a traceback.
"""

from __future__ import annotations

from specmask.orchestrator.api.error_table import (
    CONFLICT,
    GENERATION_FAILED,
    GRAMMAR_TIMEOUT,
    GRAMMAR_VIOLATION,
    INTERNAL,
    INVALID,
    MASK_TIER_DOWN,
    NOT_FOUND,
    OVERLOADED,
    REFUSED,
    UNAVAILABLE,
    UNSUPPORTED_MEDIA_TYPE,
    HttpError,
)
from specmask.orchestrator.errors import RequestError

# The shapes are the error table's (api/error_table.py); the HTTP modules take them from here.
__all__ = [
    "CONFLICT",
    "GENERATION_FAILED",
    "GRAMMAR_TIMEOUT",
    "GRAMMAR_VIOLATION",
    "INTERNAL",
    "INVALID",
    "MASK_TIER_DOWN",
    "NOT_FOUND",
    "OVERLOADED",
    "RETRY_AFTER_S",
    "UNAVAILABLE",
    "UNSUPPORTED_MEDIA_TYPE",
    "ApiError",
    "HttpError",
]

# Seconds a refused client is told to wait (429, 503) before retrying: about
# the time a batch of requests takes to finish and free admission slots.
RETRY_AFTER_S = 1


class ApiError(Exception):
    """A request refused or failed; rendered as an OpenAI error object."""

    def __init__(self, kind: HttpError, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    @classmethod
    def invalid(cls, message: str, *, param: str | None = None) -> ApiError:
        return cls(INVALID, message, param=param)

    @classmethod
    def from_request_error(cls, exc: RequestError) -> ApiError:
        return cls(REFUSED[exc.code], exc.message)

    @property
    def status(self) -> int:
        return self.kind.status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind.type, "param": self.param, "code": self.kind.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.kind.retry_after else {}
