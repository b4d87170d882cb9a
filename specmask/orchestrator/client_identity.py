"""Who an API request comes from, for fairness at the mask service's compile queue.

The mask service serves compiles round-robin by owner. Without an identity
every grammar the orchestrator validates would count as one owner, so one
client flooding distinct schemas would fill the orchestrator's share and
starve every other client's new schema. The identity travels to the replica
as the ``specmask-client`` request metadata of ValidateGrammar
(``mask_service.auth.CLIENT_METADATA_KEY``).

In order of preference:

1. the API key (``authorization: Bearer ...`` / ``x-api-key``), hashed, so
   the key itself never reaches the mask service or its logs: with keys
   configured (orchestrator.auth_keys) each key is one client, whatever
   header it sends;
2. ``specmask-client`` (gRPC metadata) / ``X-SpecMask-Client`` (HTTP header),
   where no key is sent: set by a trusted gateway in front of the
   orchestrator, or by the client;
3. the peer's host (its ephemeral port dropped).

The same identity bounds a client's requests in flight and its share of batch
slots in the orchestrator's engine (orchestrator.engine).

Fairness is not authentication: a client that sends a fresh
``specmask-client`` value with every request becomes many owners (each still
bounded per owner, all together by the queue's global bound). Deployments
that need it strict strip the header at the gateway and set it themselves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from specmask.mask_service.auth import CLIENT_METADATA_KEY

CLIENT_HTTP_HEADER = "X-SpecMask-Client"
_MAX_CHARS = 128


def _api_key(pairs: Iterable[tuple[str, str]]) -> str:
    for key, value in pairs:
        key = key.lower()
        if key == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
        if key == "x-api-key" and value:
            return value.strip()
    return ""


def peer_host(peer: str) -> str:
    """``ipv4:127.0.0.1:54321`` / ``ipv6:[::1]:54321`` / ``127.0.0.1`` -> the host part."""
    if peer.count(":") >= 2 or (peer.startswith("ipv4:") and peer.count(":") == 2):
        return peer.rsplit(":", 1)[0]
    return peer


def client_identity(pairs: Iterable[tuple[str, str]], peer: str) -> str:
    """The identity for ``pairs`` (request metadata or HTTP headers, any case) from ``peer``."""
    pairs = [(str(k), str(v)) for k, v in pairs]
    key = _api_key(pairs)
    if key:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    for name, value in pairs:
        if name.lower() in (CLIENT_METADATA_KEY, CLIENT_HTTP_HEADER.lower()) and value.strip():
            return "client:" + value.strip()[:_MAX_CHARS]
    return "peer:" + (peer_host(peer) or "unknown")[:_MAX_CHARS]
