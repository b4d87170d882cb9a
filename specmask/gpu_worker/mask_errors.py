"""How a failed mask-service call is worded for the client, and what kind of failure it is (docs/api-errors.md).

The router's exception text names replica addresses ("ipv4:127.0.0.1:34915: Failed to
connect"): useful in the worker's log, meaningless (and revealing) to a client. A tier
that cannot be reached reads ``MASK_TIER_UNAVAILABLE``; a grammar the tier refused keeps the
tier's own reason. Each failure is a ``MaskFailure``: its words and its ``ErrorKind`` are set
together where the failure is found, and the kind travels beside the words to the step
output (``StepOutput.error_kind``), which the API layers map to a status
(orchestrator.api.error_table). No layer reads the kind back out of the words.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from specmask.gpu_worker.types import ErrorKind, FinishReason, StepOutput
from specmask.mask_service.client.mask_client import MaskServiceError

# How every client-facing message about an unreachable mask tier begins (docs/api-errors.md
# promises it); the status comes from ErrorKind.MASK_TIER_UNAVAILABLE, never from these words.
MASK_TIER_UNAVAILABLE = "mask tier unavailable"
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


@dataclass(frozen=True)
class MaskFailure:
    """Why a sequence's mask call failed: the words the client reads, and the kind its step
    output carries (which decides the status the APIs answer with)."""

    message: str
    kind: ErrorKind

    @classmethod
    def tier_unavailable(cls, what: str) -> MaskFailure:
        """No replica answered ``what`` (e.g. "opening the grammar session failed"): a retry may succeed."""
        return cls(f"{MASK_TIER_UNAVAILABLE}: {what}; retry", ErrorKind.MASK_TIER_UNAVAILABLE)

    @classmethod
    def internal(cls, message: str) -> MaskFailure:
        """The service answered something the worker cannot use: a server fault."""
        return cls(message, ErrorKind.INTERNAL)

    def output(self, seq_id: str) -> StepOutput:
        """The step output that ends ``seq_id`` with this failure."""
        return StepOutput(seq_id, [], FinishReason.ERROR, error=self.message, error_kind=self.kind)


def describe_mask_failure(exc: BaseException, doing: str) -> MaskFailure:
    """The failure ``exc`` (raised while ``doing``, e.g. "opening the grammar session") is for the client."""
    if isinstance(exc, MaskServiceError):
        if exc.code in _UNREACHABLE:
            return MaskFailure.tier_unavailable(f"{doing} failed (no mask service replica answered)")
        if exc.code in _REFUSED:
            # The orchestrator validated the grammar before admitting the request
            # (orchestrator.validation): a refusal past that point is the server's fault.
            return MaskFailure.internal(f"grammar refused by the mask service: {exc.message}")
        return MaskFailure.internal(f"mask service failed while {doing} ({exc.code.name}): {exc.message}")
    return MaskFailure.internal(f"mask service failed while {doing} ({type(exc).__name__})")
