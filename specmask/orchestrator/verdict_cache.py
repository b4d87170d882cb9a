"""The mask tier's recent verdicts on grammars, kept by the orchestrator.

Every grammar request used to cost a ValidateGrammar round trip to the mask
tier before placement, even for a schema the tier had accepted a moment ago: on
the critical path of every request (longest while a flood kept the tier busy),
and one RPC
per request on the tier. A flood that repeats one 300 KB pathological schema
sent all 300 KB to a replica each time, to be refused from its cache there.

This cache keeps what the tier answered, by the grammar's digest
(``GrammarSpec.cache_key``), for ``ttl_s``:

* **accepted**: the ``GrammarReport`` (enforcement, backend, relaxed keywords),
  all fixed by the grammar and the tier's configuration. Used only while the
  caller says the tier is reachable (the orchestrator's readiness probe), so a
  request for a known grammar still fails fast with UNAVAILABLE when the whole
  tier is down, as it did when it was checked every time.
* **refused for the grammar's own sake** (invalid, over a structural limit, too
  complex to compile): the refusal, raised again as the tier worded it. Other
  refusals (an unknown tokenizer: a deployment error) and every transient
  answer (busy, timed out, unreachable) are never kept.

``ttl_s`` bounds how long a change of the tier's configuration (new limits, a
new engine version) takes to reach clients of a running orchestrator; within
it, a grammar the tier now refuses is refused at the worker's session open
instead (a finished request with an error, never unconstrained output).
Bounded in entries (least recently used goes first); thread-safe, since
validation runs on the orchestrator's executor threads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from specmask.orchestrator.errors import InvalidRequest
from specmask.orchestrator.types import GrammarReport

DEFAULT_MAX_ENTRIES = 4096
DEFAULT_TTL_S = 300.0

# ErrorInfo reasons of refusals that depend on the grammar alone (mask_service.errors,
# mask_service.limits), so the same grammar is refused again on any replica.
GRAMMAR_REASONS = frozenset({"GRAMMAR_ERROR", "GRAMMAR_LIMIT_ERROR", "GRAMMAR_TOO_COMPLEX"})


@dataclass(frozen=True)
class _Refusal:
    message: str
    reason: str
    field: str

    def error(self) -> InvalidRequest:
        return InvalidRequest(self.message, reason=self.reason, field=self.field)


class VerdictCache:
    """``get(key)`` -> a GrammarReport, raises the cached refusal, or None (ask the tier)."""

    def __init__(
        self,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0 (0 = off), got {max_entries}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._max = max_entries
        self._ttl = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[float, GrammarReport | _Refusal]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, *, tier_reachable: bool) -> GrammarReport | None:
        """The cached acceptance (only when ``tier_reachable``), None to ask the tier;
        raises the cached refusal (``InvalidRequest``) whatever the tier's state."""
        now = self._clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] <= now:
                del self._entries[key]
                entry = None
            if entry is None or (isinstance(entry[1], GrammarReport) and not tier_reachable):
                return None
            self._entries.move_to_end(key)
            verdict = entry[1]
        if isinstance(verdict, _Refusal):
            raise verdict.error()
        return verdict

    def accepted(self, key: str, report: GrammarReport) -> None:
        self._put(key, report)

    def refused(self, key: str, error: InvalidRequest) -> None:
        """Keep ``error`` if it is a refusal for the grammar's own sake (``GRAMMAR_REASONS``)."""
        if error.reason in GRAMMAR_REASONS:
            self._put(key, _Refusal(error.message, error.reason, error.field))

    def _put(self, key: str, verdict: GrammarReport | _Refusal) -> None:
        if self._max == 0:
            return
        with self._lock:
            self._entries[key] = (self._clock() + self._ttl, verdict)
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
