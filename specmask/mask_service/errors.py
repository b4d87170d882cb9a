"""Typed domain errors of the mask service, each bound to one gRPC status.

Domain code raises these; the servicer turns them into that status in one place
(a call's, or a DraftMasks item's ``error_code``), so a client never sees a
traceback and a bad request never kills the server. Each class names its
``grpc.StatusCode`` itself: a copy of the status names would be a second
mapping to keep in step.
"""

from __future__ import annotations

import grpc


class MaskError(Exception):
    """Base class: ``code`` says which status the client gets."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InternalItemError(MaskError):
    """An unexpected failure while serving one item of a batch call (logged with its
    traceback); INTERNAL for that item alone, the call's other items are answered."""


class InvalidArgument(MaskError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class GrammarError(InvalidArgument):
    """The engine refused the grammar (message is the engine's), or we refuse a feature."""


class GrammarTooComplex(GrammarError):
    """The compile passed its time budget or memory cap and was killed.

    INVALID_ARGUMENT, not DEADLINE_EXCEEDED: the same grammar would exceed the
    same budget on any replica, so neither a client retry nor the router's
    failover may try it again (and no replica is marked dead for it).
    """


class UnknownTokenizer(InvalidArgument):
    pass


class SessionNotFound(MaskError):
    code = grpc.StatusCode.NOT_FOUND


class NotOwner(MaskError):
    """A call on a session names another owner than the one that opened it."""

    code = grpc.StatusCode.PERMISSION_DENIED


class TokenRejected(MaskError):
    """A committed token the grammar does not allow; state was rolled back."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class LimitExceeded(MaskError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
