"""Shared-token authentication between the mask service and its callers.

Without it, any client that reached a replica could fill its session table in
about a second. Every MaskService RPC must carry ``authorization: Bearer
<token>`` metadata equal to the replica's token; health and reflection stay
open (kubelet probes carry no token). The token comes from ``--auth-token`` or
the ``SPECMASK_MASK_TOKEN`` environment variable on both sides, so GPU workers
(Ray actors inherit the driver's environment) and the orchestrator send it
without extra plumbing.

A shared token authenticates the *tier*, not each caller: in production run
the mask service behind mTLS as well (grpc.ssl_server_credentials with
require_client_auth=True, one client certificate per worker identity), which
also encrypts the traffic; see docs/security-and-fairness.md, "The mask-service token".
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from typing import Any

import grpc

TOKEN_ENV = "SPECMASK_MASK_TOKEN"
AUTH_METADATA_KEY = "authorization"
# Names the end client a grammar is compiled for (the orchestrator sets it on
# ValidateGrammar: orchestrator.client_identity), so the replica's compile queue is
# fair between API clients, not only between the processes that call it.
CLIENT_METADATA_KEY = "specmask-client"
_PROTECTED_PREFIX = "/specmask.mask.v1.MaskService/"


# Keys the secret part of session owners (owner_tag); unset: the mask token does.
OWNER_SECRET_ENV = "SPECMASK_SESSION_OWNER_SECRET"
_OWNER_SEPARATOR = "#"


def token_from_env() -> str:
    return os.environ.get(TOKEN_ENV, "")


def owner_tag(public: str, secret: str | None = None) -> str:
    """A session owner that only its holder can name: ``public`` (what logs show, e.g. the
    worker's Ray actor id) plus an HMAC of it under ``secret`` (default: $SPECMASK_SESSION_OWNER_SECRET,
    else the mask token). ReleaseOwner closes sessions by owner, so an owner read from a
    log line no longer releases anything: the caller must hold the whole tag, which the
    process that opened the sessions (and the orchestrator, over Ray) has, and which a
    restarted process with the same ``public`` id computes again."""
    key = secret if secret is not None else os.environ.get(OWNER_SECRET_ENV) or token_from_env()
    if not public or not key:
        return public
    mac = hmac.new(key.encode(), public.encode(), "sha256").hexdigest()[:32]
    return f"{public}{_OWNER_SEPARATOR}{mac}"


def public_owner(owner: str) -> str:
    """The part of an owner tag that may be logged."""
    return owner.split(_OWNER_SEPARATOR, 1)[0]


def client_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Metadata a caller sends with every MaskService RPC (empty without a token)."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses MaskService RPCs without the replica's token (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenAuthInterceptor needs a non-empty token")
        self._expected = f"Bearer {token}".encode()

        def deny(_request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong mask-service token (SPECMASK_MASK_TOKEN)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        if not details.method.startswith(_PROTECTED_PREFIX):
            return continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(given, self._expected):
                    return continuation(details)
        return self._deny
