"""API-key authentication and CORS for the HTTP API, as aiohttp middlewares.

``api_key_middleware(keys)``: with keys configured (orchestrator.auth_keys), a
request without one of them gets 401 in OpenAI's error shape
(``{"error": {..., "type": "invalid_request_error", "code": "invalid_api_key"}}``)
and ``WWW-Authenticate: Bearer``; the health endpoint and CORS preflights stay
open. Without keys it passes everything through.

``enable_cors(app, origins)``: browsers on ``origins`` (``*`` = any) may call the
API: preflight ``OPTIONS`` is answered here (before authentication: a browser
sends no key with it), and every response, streams included, carries
``Access-Control-Allow-Origin``. Off unless origins are given.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from specmask.orchestrator.auth_keys import ApiKeys

# Paths a probe or scraper reaches without a key.
OPEN_PATHS = frozenset({"/health", "/healthz", "/readyz", "/livez", "/metrics"})
_ALLOWED_HEADERS = "Authorization, Content-Type, X-Api-Key, X-SpecMask-Client, X-Request-Id"
_ALLOWED_METHODS = "GET, POST, OPTIONS"
_PREFLIGHT_MAX_AGE_S = 600


def unauthorized_body(message: str) -> dict[str, dict[str, str | None]]:
    """OpenAI's error object for a missing or wrong key."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


def api_key_middleware(keys: ApiKeys) -> Middleware:
    """Refuse requests without one of ``keys`` (401), but for OPEN_PATHS and preflights."""

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not keys.enabled or request.path in OPEN_PATHS or request.method == "OPTIONS":
            return await handler(request)
        if keys.allows(request.headers.items()):
            return await handler(request)
        given = "Authorization" in request.headers or "X-Api-Key" in request.headers
        message = (
            "Incorrect API key provided."
            if given
            else "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
        )
        return web.json_response(unauthorized_body(message), status=401, headers={"WWW-Authenticate": "Bearer"})

    return check_api_key


def _allowed_origin(origin: str, origins: frozenset[str]) -> str | None:
    if not origin:
        return None
    if "*" in origins:
        return "*"
    return origin if origin in origins else None


def enable_cors(app: web.Application, origins: Sequence[str]) -> None:
    """Answer preflights and label responses for ``origins`` (call before the app starts).
    Prepend the returned middleware's effect: it is inserted first, ahead of authentication."""
    allowed = frozenset(o.strip().rstrip("/") for o in origins if o.strip())
    if not allowed:
        return

    @web.middleware
    async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            origin = _allowed_origin(request.headers.get("Origin", ""), allowed)
            if origin is None:
                return web.Response(status=403, text="origin not allowed")
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Origin": origin,
                    "Access-Control-Allow-Methods": _ALLOWED_METHODS,
                    "Access-Control-Allow-Headers": _ALLOWED_HEADERS,
                    "Access-Control-Max-Age": str(_PREFLIGHT_MAX_AGE_S),
                    "Vary": "Origin",
                },
            )
        return await handler(request)

    async def label(request: web.Request, response: web.StreamResponse) -> None:
        # on_response_prepare: also reaches streamed (SSE) responses, whose headers
        # are sent before their handler returns.
        origin = _allowed_origin(request.headers.get("Origin", ""), allowed)
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"

    app.middlewares.insert(0, preflight)
    app.on_response_prepare.append(label)
