"""OpenAI-style error objects and the one mapping from domain errors to HTTP status codes.

Every refusal a client can get from the HTTP API is an ``ApiError``; the app's
middleware turns it into ``{"error": {"message", "type", "param", "code"}}``
with its status, so no handler ever answers with a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass

from specmask.orchestrator.errors import ErrorCode, RequestError

# Seconds a refused client is told to wait (429, 503) before retrying: about
# the time a batch of requests takes to finish and free admission slots.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class HttpError:
    """How one kind of failure looks on the wire."""

    status: int
    type: str
    code: str | None = None
    retry_after: bool = False


INVALID = HttpError(400, "invalid_request_error")
NOT_FOUND = HttpError(404, "not_found_error", "model_not_found")
CONFLICT = HttpError(409, "invalid_request_error", "duplicate_request_id")
OVERLOADED = HttpError(429, "rate_limit_error", "rate_limit_exceeded", retry_after=True)
UNAVAILABLE = HttpError(503, "service_unavailable", "service_unavailable", retry_after=True)
INTERNAL = HttpError(500, "server_error", "internal_error")
GENERATION_FAILED = HttpError(500, "server_error", "generation_failed")
# An output that broke the caller's grammar was caught (the end check, the device check, or
# checked mode's attempts all failed): the request was fine, the server failed to honour it.
GRAMMAR_VIOLATION = HttpError(500, "grammar_violation", "grammar_violation")
# The mask tier went away while the request ran (its words: gpu_worker.mask_errors).
MASK_TIER_DOWN = HttpError(503, "service_unavailable", "mask_tier_unavailable", retry_after=True)
UNSUPPORTED_MEDIA_TYPE = HttpError(415, "invalid_request_error", "unsupported_media_type")

# Domain error code -> wire shape. DEADLINE_EXCEEDED is a grammar that did not
# compile in time: the request (its schema) is what is refused.
_BY_CODE: dict[ErrorCode, HttpError] = {
    ErrorCode.INVALID_ARGUMENT: INVALID,
    ErrorCode.ALREADY_EXISTS: CONFLICT,
    ErrorCode.RESOURCE_EXHAUSTED: OVERLOADED,
    ErrorCode.UNAVAILABLE: UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: HttpError(400, "invalid_request_error", "grammar_timeout"),
    ErrorCode.INTERNAL: INTERNAL,
}


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
        return cls(_BY_CODE.get(exc.code, INTERNAL), exc.message)

    @property
    def status(self) -> int:
        return self.kind.status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind.type, "param": self.param, "code": self.kind.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.kind.retry_after else {}
