"""How a failed mask-service call is worded for the client (docs/api-errors.md).

The router's exception text names replica addresses ("ipv4:127.0.0.1:34915: Failed to
connect"): useful in the worker's log, meaningless (and revealing) to a client. A tier
that cannot be reached reads ``MASK_TIER_UNAVAILABLE``, which the HTTP API maps to 503;
a grammar the tier refused keeps the tier's own reason. ``failure_kind`` gives the
``ErrorKind`` the step output carries, so the API layers never read these words.
"""

from __future__ import annotations

import grpc

from specmask.gpu_worker.types import ErrorKind
from specmask.mask_service.client.mask_client import MaskServiceError

# The prefix of every client-facing message about an unreachable mask tier (HTTP 503).
MASK_TIER_UNAVAILABLE = "mask tier unavailable"
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


def describe_mask_failure(exc: BaseException, doing: str) -> str:
    """One line for the client about ``exc``, raised while ``doing`` (e.g. "opening the grammar session")."""
    if isinstance(exc, MaskServiceError):
        if exc.code in _UNREACHABLE:
            return f"{MASK_TIER_UNAVAILABLE}: {doing} failed (no mask service replica answered); retry"
        if exc.code in _REFUSED:
            return f"grammar refused by the mask service: {exc.message}"
        return f"mask service failed while {doing} ({exc.code.name}): {exc.message}"
    return f"mask service failed while {doing} ({type(exc).__name__})"


def failure_kind(message: str) -> ErrorKind:
    """The kind of a mask failure worded here (``describe_mask_failure``, or a message that starts
    with ``MASK_TIER_UNAVAILABLE``): this module writes the words, so it alone reads them back,
    where the failure becomes a step output."""
    return ErrorKind.MASK_TIER_UNAVAILABLE if message.startswith(MASK_TIER_UNAVAILABLE) else ErrorKind.INTERNAL
