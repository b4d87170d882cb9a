"""Server-Sent Events on an aiohttp response: ``data: <json>\\n\\n`` events, then ``data: [DONE]``.

An error after the 200 header went out is sent as one ``data: {"error": ...}``
event and the stream ends without ``[DONE]`` (the openai SDK raises on such an
event), so a failed generation never reads as a complete one.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from specmask.orchestrator.api.http.errors import ApiError

_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _encode(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStream:
    def __init__(self, response: web.StreamResponse) -> None:
        self._response = response

    @classmethod
    async def open(cls, request: web.Request, extra_headers: dict[str, str]) -> EventStream:
        response = web.StreamResponse(status=200, headers={**_HEADERS, **extra_headers})
        await response.prepare(request)
        return cls(response)

    async def send(self, obj: Any) -> None:
        await self._response.write(_encode(obj))

    async def send_raw(self, event: bytes) -> None:
        """An already encoded event (``DeltaEncoder``): the per-token hot path."""
        await self._response.write(event)

    async def error(self, exc: ApiError) -> None:
        await self._response.write(_encode(exc.body()))

    async def done(self) -> None:
        await self._response.write(b"data: [DONE]\n\n")
        await self._response.write_eof()

    @property
    def response(self) -> web.StreamResponse:
        return self._response


class DeltaEncoder:
    """Encodes the per-token text chunks of one stream without rebuilding and re-serialising
    the whole envelope for each: the constant parts around the text are encoded once.

    ``template`` is a chunk body whose text field holds ``PLACEHOLDER``; ``encode(text)``
    equals ``_encode`` of that body with the text in place (tests check it).
    """

    PLACEHOLDER = "\x00specmask-delta\x00"

    def __init__(self, template: Any) -> None:
        body = json.dumps(template, ensure_ascii=False, separators=(",", ":"))
        marker = json.dumps(self.PLACEHOLDER, ensure_ascii=False)
        prefix, suffix = body.split(marker)
        self._prefix = b"data: " + prefix.encode()
        self._suffix = suffix.encode() + b"\n\n"

    def encode(self, text: str) -> bytes:
        return self._prefix + json.dumps(text, ensure_ascii=False).encode() + self._suffix
