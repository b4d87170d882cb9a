"""Stop strings over a stream of text deltas.

Generation stops at the first occurrence of any stop string; the returned text
ends right before it (OpenAI semantics). While streaming, text that could be
the beginning of a stop string is held back, so a client never receives
characters that are later cut off.

Beside a grammar, a stop string ends the output only where the grammar may end:
an occurrence counts only if the text before it is a complete sentence of the
grammar (``may_end``, the end-of-request check). An occurrence inside a sentence
is ignored and generation goes on, so a stop string can never cut a grammar's
output into something outside its language (docs/api-errors.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Occurrences one request may ask ``may_end`` about. Each ask parses the text so far on the
# event loop; a stop string that the grammar's text repeats (``"}"`` in nested JSON) would
# otherwise cost a parse per occurrence. Occurrences past the cap are ignored: the grammar's
# own end (or max_tokens) still ends the output.
MAX_END_CHECKS = 64


class StopStringMatcher:
    """Per-request matcher; feed text deltas in order.

    ``may_end(text)``: whether the output may end with ``text`` (a grammar request: the end
    check of its grammar); None = any occurrence ends the output.
    """

    def __init__(
        self,
        stop_strings: Sequence[str],
        may_end: Callable[[str], bool] | None = None,
        *,
        max_end_checks: int = MAX_END_CHECKS,
    ) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stop_strings)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._may_end = may_end
        self._checks_left = max_end_checks
        self._text = ""  # everything fed so far
        self._emitted = 0  # characters of _text returned; no occurrence can start before this but refused ones
        self._refused: set[int] = set()  # positions whose preceding text is not a sentence of the grammar
        self.matched: str | None = None  # the stop string that ended generation
        self._matched_at = 0

    @property
    def text_before_match(self) -> str:
        """The output a hit ended: everything before the matched stop string."""
        return self._text[: self._matched_at] if self.matched is not None else self._text

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit).

        After a hit, further calls return ("", True).
        """
        if self.matched is not None:
            return "", True
        if not self._stops:
            return text, False
        self._text += text
        hit = self._first_hit()
        if hit is not None:
            at, self.matched = hit
            self._matched_at = at
            out, self._emitted = self._text[self._emitted : at], at
            return out, True
        hold_from = self._hold_from()
        out, self._emitted = self._text[self._emitted : hold_from], hold_from
        return out, False

    def flush(self) -> str:
        """At the end of generation (no stop hit): release the held-back text."""
        out, self._emitted = self._text[self._emitted :], len(self._text)
        return out

    def _first_hit(self) -> tuple[int, str] | None:
        """The earliest occurrence that may end the output; among stops at one index, the first listed."""
        while True:
            best: tuple[int, str] | None = None
            for stop in self._stops:
                i = self._text.find(stop, self._emitted)
                while i != -1 and i in self._refused:
                    i = self._text.find(stop, i + 1)
                if i != -1 and (best is None or i < best[0]):
                    best = (i, stop)
            if best is None or self._ends_here(best[0]):
                return best
            self._refused.add(best[0])  # every stop at this index: they share the preceding text

    def _ends_here(self, at: int) -> bool:
        if self._may_end is None:
            return True
        if self._checks_left <= 0:
            return False
        self._checks_left -= 1
        try:
            return bool(self._may_end(self._text[:at]))
        except Exception:  # an unverifiable end is not an end (fails closed)
            return False

    def _hold_from(self) -> int:
        """Where the held-back tail starts: the earliest position from which the rest of the
        text is a proper prefix of a stop string (and that position may still end the output)."""
        end = len(self._text)
        for n in range(min(end - self._emitted, self._max_hold), 0, -1):
            if end - n in self._refused:
                continue
            tail = self._text[end - n :]
            if any(s.startswith(tail) for s in self._stops):
                return end - n
        return end
