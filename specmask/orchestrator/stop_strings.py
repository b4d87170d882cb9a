"""Stop strings over a stream of text deltas.

Generation stops at the first occurrence of any stop string; the returned text
ends right before it (OpenAI semantics), or right after it with vLLM's
``include_stop_str_in_output``. A stop token (vLLM's ``stop_token_ids``) ends
it at a token instead (``end``). While streaming, text that could be
the beginning of a stop string is held back, so a client never receives
characters that are later cut off.

Before ``min_tokens`` (vLLM's): an occurrence counts only if it ends in the text of a token
after the ``min_tokens``-th (it may start before). The caller feeds the first tokens' text
with ``may_stop=False``; that text is the floor no counted occurrence ends within.

Beside a grammar, a stop string ends the output only where the grammar may end:
an occurrence counts only if the text before it is a complete sentence of the
grammar (``may_end``, the end-of-request check), the returned text (with the stop
string when it is included) is what is checked. An occurrence inside a sentence
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
        include: bool = False,
    ) -> None:
        """``include``: the returned text keeps the matched stop string (vLLM's
        ``include_stop_str_in_output``)."""
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stop_strings)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._may_end = may_end
        self._include = include
        self._checks_left = max_end_checks
        self._text = ""  # everything fed so far
        self._floor = 0  # characters fed with may_stop=False: no occurrence ending within them counts
        self._emitted = 0  # characters of _text returned; no occurrence can start before this but refused ones
        self._refused: set[int] = set()  # positions whose preceding text is not a sentence of the grammar
        # include: (position, stop string) pairs whose text through the stop is not a sentence.
        self._refused_stops: dict[int, set[str]] = {}
        self.matched: str | None = None  # the stop string (or stop token's text) that ended generation
        self._matched_at = 0  # where the returned output ends

    @property
    def text_before_match(self) -> str:
        """The output a hit ended: everything before the matched stop string (through it when
        included)."""
        return self._text[: self._matched_at] if self.matched is not None else self._text

    def end(self, tail: str) -> str | None:
        """A stop token was sampled: end the output after the text fed so far and ``tail`` (the
        token's text when it is included, else ""), if the output may end there. Returns the
        text to emit now (the held-back text and ``tail``), or None when the output may not end
        there (a grammar request inside a sentence): the caller then goes on as if the token
        were any other. Stop strings in ``tail`` are not searched (it is the stop token's)."""
        if self.matched is not None:
            return ""
        if not self._ends_with(self._text + tail):
            return None
        self._text += tail
        self.matched = tail
        self._matched_at = len(self._text)
        out, self._emitted = self._text[self._emitted :], len(self._text)
        return out

    def feed(self, text: str, *, may_stop: bool = True) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit).

        ``may_stop=False``: the text of tokens before ``min_tokens``; no occurrence that ends
        within it counts (one that ends in later text does, wherever it starts). After a hit,
        further calls return ("", True).
        """
        if self.matched is not None:
            return "", True
        self._text += text
        if not may_stop:
            self._floor = len(self._text)
        if not self._stops:
            self._emitted = len(self._text)  # kept for a stop token's end check (``end``)
            return text, False
        hit = self._first_hit()
        if hit is not None:
            at, self.matched = hit
            end = at + len(self.matched) if self._include else at
            self._matched_at = end
            out, self._emitted = self._text[self._emitted : end], end
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
                # An occurrence at i ends at i + len(stop): past the floor from here on.
                i = self._text.find(stop, max(self._emitted, self._floor - len(stop) + 1))
                while i != -1 and (i in self._refused or stop in self._refused_stops.get(i, ())):
                    i = self._text.find(stop, i + 1)
                if i != -1 and (best is None or i < best[0]):
                    best = (i, stop)
            if best is None:
                return None
            at, stop = best
            if self._ends_with(self._text[: at + len(stop)] if self._include else self._text[:at]):
                return best
            if self._include:
                # Only this stop string's end was refused: another one at the same index ends
                # elsewhere and is asked about on its own.
                self._refused_stops.setdefault(at, set()).add(stop)
                continue
            self._refused.add(at)  # every stop at this index: they share the preceding text

    def _ends_with(self, output: str) -> bool:
        """Whether the returned output may be ``output`` (the grammar's end check)."""
        if self._may_end is None:
            return True
        if self._checks_left <= 0:
            return False
        self._checks_left -= 1
        try:
            return bool(self._may_end(output))
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
