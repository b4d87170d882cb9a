"""Single flight: concurrent callers with the same key share one call.

A client that sends a burst of requests with one schema the mask tier has not
compiled yet made each request a ValidateGrammar call, and each call a waiter on
the replica's one compile of that schema. Waiters are bounded per client (each
holds a gRPC thread on the replica), so past that bound (12 by default) the burst
got RESOURCE_EXHAUSTED "busy compiling" for a schema that needed one compile.
With one call per (schema, client) in flight, the burst costs the replica one
waiter, and every request in it gets that call's answer.

Blocking (threads), like the validation path that uses it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """``run(key, fn)``: the first caller for ``key`` runs ``fn``; callers that arrive
    while it runs wait for it and get its result, or its exception raised again.
    Nothing is cached past the call: the next caller after it ends runs ``fn`` anew."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[Hashable, Future[T]] = {}

    def run(self, key: Hashable, fn: Callable[[], T]) -> T:
        with self._lock:
            fut = self._calls.get(key)
            leader = fut is None
            if fut is None:
                fut = Future()
                self._calls[key] = fut
        if not leader:
            return fut.result()  # the leader's call has its own deadline: this wait ends with it
        try:
            result = fn()
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        else:
            fut.set_result(result)
            return result
        finally:
            with self._lock:
                del self._calls[key]

    def in_flight(self) -> int:
        """Calls running now (for tests and metrics)."""
        with self._lock:
            return len(self._calls)
