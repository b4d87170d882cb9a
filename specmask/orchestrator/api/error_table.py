"""How each kind of error looks on each front door, HTTP and gRPC, in one table.

Two families, both typed, neither read from a message's words:

* a request *refused* before generation (``orchestrator.errors.RequestError``, by its
  ``grpc.StatusCode``): the RPC ends with that status, and HTTP answers the error this
  table gives it;
* a request that *failed* during generation (``gpu_worker.types.ErrorKind``, set on the step
  output or by the engine): an HTTP error response instead of the output; on gRPC the RPC
  itself succeeds and the response reports it in-band (``finish_reason`` ERROR or
  GRAMMAR_VIOLATION, and ``error``), so its gRPC status is OK here.

docs/api-errors.md lists what a client sees for each.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from specmask.gpu_worker.types import ErrorKind


@dataclass(frozen=True)
class HttpError:
    """How one kind of failure looks on the HTTP wire (an OpenAI error object's status, type, code)."""

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
GRAMMAR_TIMEOUT = HttpError(400, "invalid_request_error", "grammar_timeout")
GRAMMAR_VIOLATION = HttpError(500, "grammar_violation", "grammar_violation")
# The mask tier went away while the request ran (its words: gpu_worker.mask_errors).
MASK_TIER_DOWN = HttpError(503, "service_unavailable", "mask_tier_unavailable", retry_after=True)
UNSUPPORTED_MEDIA_TYPE = HttpError(415, "invalid_request_error", "unsupported_media_type")


@dataclass(frozen=True)
class WireError:
    """One kind of error on the wire."""

    http: HttpError
    # The RPC's status; OK for a failure during generation, which the response itself reports
    # (finish_reason ERROR or GRAMMAR_VIOLATION, and error).
    grpc: grpc.StatusCode
    param: str | None = None  # the request field at fault (HTTP's error.param)
    # HTTP message: the error's own text (False: "generation failed (<reason>): <text>", a server fault's wording).
    own_words: bool = True


# Refusals, by the status a RequestError names (on gRPC the RPC ends with that very status).
# DEADLINE_EXCEEDED is a grammar that did not compile in time: the request (its schema) is what
# is refused, so HTTP answers 400, while gRPC keeps the status that names the cause.
REFUSED: dict[grpc.StatusCode, HttpError] = {
    grpc.StatusCode.INVALID_ARGUMENT: INVALID,
    grpc.StatusCode.ALREADY_EXISTS: CONFLICT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OVERLOADED,
    grpc.StatusCode.UNAVAILABLE: UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: GRAMMAR_TIMEOUT,
    grpc.StatusCode.INTERNAL: INTERNAL,
}

# Failures during generation (gRPC: the RPC succeeds; its response says what failed).
FAILED: dict[ErrorKind, WireError] = {
    ErrorKind.INTERNAL: WireError(GENERATION_FAILED, grpc.StatusCode.OK, own_words=False),
    # The mask tier went away while the request ran: 503 with a retry hint.
    ErrorKind.MASK_TIER_UNAVAILABLE: WireError(MASK_TIER_DOWN, grpc.StatusCode.OK),
    # The request asked for what its own grammar forbids (the grammar ends before min_tokens):
    # the caller's to fix, so a 400 naming the field, not a server error.
    ErrorKind.MIN_TOKENS_UNREACHABLE: WireError(INVALID, grpc.StatusCode.OK, param="min_tokens"),
    # An output that broke the caller's grammar was caught (the end check, the device check, or
    # checked mode's attempts all failed): the request was fine, the server failed to honour it.
    ErrorKind.GRAMMAR_VIOLATION: WireError(GRAMMAR_VIOLATION, grpc.StatusCode.OK),
}
