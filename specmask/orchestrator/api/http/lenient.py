"""Request fields this server does not know: ignored, logged once per name, counted.

OpenAI's SDKs add fields with every release (``reasoning_effort``,
``prompt_cache_key``, ``safety_identifier``, ...) and frameworks send their own;
like vLLM, the server ignores a field it does not know instead of refusing the
request. Known fields stay strictly typed (``protocol``): a known field with a
wrong type or value is still a 400.

The request models keep unknown fields aside (pydantic ``extra="allow"``); this
module finds them anywhere in the body (``messages[].annotations``: list
positions are left out so a name is per field, not per message), logs each new
name once at WARNING, and counts every occurrence in
``specmask_http_unknown_fields_total{field}``. The label takes the first
``MAX_NAMED_FIELDS`` distinct names; later names count as ``other``, so clients
cannot grow the metric without bound.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from prometheus_client import Counter
from pydantic import BaseModel

logger = logging.getLogger(__name__)

MAX_NAMED_FIELDS = 64
OTHER = "other"


def unknown_fields(body: BaseModel, prefix: str = "") -> Iterator[str]:
    """Dotted paths of the fields ``body`` (and the models inside it) did not declare."""
    for name in body.model_extra or {}:
        yield prefix + name
    for name in type(body).model_fields:
        yield from _unknown_in(getattr(body, name), f"{prefix}{name}")


def _unknown_in(value: object, path: str) -> Iterator[str]:
    if isinstance(value, BaseModel):
        yield from unknown_fields(value, path + ".")
    elif isinstance(value, list):
        for item in value:
            yield from _unknown_in(item, path + "[]")


class UnknownFieldLog:
    """Logs and counts the unknown fields of each request body."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def note(self, body: BaseModel, request_id: str) -> list[str]:
        """The unknown fields of ``body`` (each once), after logging and counting them."""
        names = sorted(set(unknown_fields(body)))
        for name in names:
            with self._lock:
                new = name not in self._named and len(self._named) < MAX_NAMED_FIELDS
                if new:
                    self._named.add(name)
                label = name if name in self._named else OTHER
            if new:
                logger.warning(
                    "[request_id=%s] ignoring request field %r, which this server does not know "
                    "(logged once per field name; counted in specmask_http_unknown_fields_total)",
                    request_id,
                    name[:128],
                )
            self._counter.labels(field=label).inc()
        return names
