"""Stop strings over a stream of text deltas.

Generation stops at the first occurrence of any stop string; the returned text
ends right before it (OpenAI semantics). While streaming, text that could be
the beginning of a stop string is held back, so a client never receives
characters that are later cut off.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Per-request matcher; feed text deltas in order."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stop_strings)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None  # the stop string that ended generation

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit).

        After a hit, further calls return ("", True).
        """
        if self.matched is not None:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        # The earliest occurrence wins; among stops at the same index, the
        # first listed. Occurrences cannot start inside already-emitted text,
        # because any suffix that could begin a stop string was held back.
        hit_at, hit = -1, None
        for stop in self._stops:
            i = buf.find(stop)
            if i != -1 and (hit_at == -1 or i < hit_at):
                hit_at, hit = i, stop
        if hit is not None:
            self.matched = hit
            self._held = ""
            return buf[:hit_at], True
        hold = self._longest_stop_prefix_suffix(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """At the end of generation (no stop hit): release the held-back text."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for n in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
