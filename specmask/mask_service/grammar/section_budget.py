"""A token budget on a reasoning section: after ``max_tokens`` tokens the section must close.

A grammar's reasoning section (common/reasoning_section.py) is free text up to its
closing tag. ``SectionBudget`` wraps a session's matcher and counts the tokens
accepted while the section is open; once ``max_tokens`` of them are in, each row
allows only the tokens that spell the next bytes of the rest of the section (the
rest of the opening tag if unfinished, the closing tag from the longest part of it
already written, then the gap), intersected with the grammar's own row, and
``accept_token`` refuses every other token. After the section closes it only
passes calls through.

The budget is part of the session's grammar: rows, drafts, forced runs and commits
all go through this one matcher, so every position sees the same state and
speculation stays exact. Rolled back, it rolls back with the grammar.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from specmask.common.reasoning_section import ReasoningSection
from specmask.mask_service.protocols import GrammarMatcher


class SectionBudget:
    """A ``GrammarMatcher`` that forces the section's end after ``section.max_tokens`` tokens."""

    __slots__ = (
        "_all_bytes",
        "_by_bytes",
        "_close",
        "_close_at",
        "_gap",
        "_lens",
        "_max",
        "_num_words",
        "_open",
        "_text",
        "inner",
    )

    def __init__(
        self,
        inner: GrammarMatcher,
        section: ReasoningSection,
        all_bytes: Sequence[bytes],
        by_bytes: Mapping[bytes, Sequence[int]],
        num_words: int,
    ) -> None:
        """``all_bytes``: each token's bytes; ``by_bytes``: token ids by their exact bytes, for
        every byte string without a double quote (json_keys.KeyVocab), so the tags hold none."""
        if section.max_tokens < 1:
            raise ValueError("a section budget needs max_tokens >= 1")
        if '"' in section.open + section.close + section.gap:
            raise ValueError("a budgeted section's tags hold no double quote")
        self.inner = inner
        self._all_bytes = all_bytes
        self._open = section.open.encode("utf-8")
        self._close = section.close.encode("utf-8")
        self._gap = section.gap.encode("utf-8")
        self._max = section.max_tokens
        self._by_bytes = by_bytes
        self._num_words = num_words
        self._text = bytearray()  # the bytes accepted until the section closed
        self._lens: list[int] = []  # len(_text) before each accepted token
        self._close_at = -1  # where the closing tag starts in _text (-1: not written yet)

    def _closed(self) -> bool:
        return self._close_at >= 0 and len(self._text) >= self._close_at + len(self._close) + len(self._gap)

    def _rest(self) -> bytes | None:
        """What the section still has to write once the budget is spent (None: not spent, or closed)."""
        if len(self._lens) < self._max or self._closed():
            return None
        text = bytes(self._text)
        if len(text) < len(self._open):
            return self._open[len(text) :] + self._close + self._gap
        if self._close_at >= 0:
            return self._gap[len(text) - self._close_at - len(self._close) :]
        body = text[len(self._open) :]
        for k in range(min(len(self._close) - 1, len(body)), 0, -1):
            if body.endswith(self._close[:k]):
                return self._close[k:] + self._gap
        return self._close + self._gap

    def _allowed(self, rest: bytes) -> list[int]:
        return [t for n in range(1, len(rest) + 1) for t in self._by_bytes.get(rest[:n], ())]

    def accept_token(self, token_id: int, /) -> bool:
        rest = self._rest()
        if rest is not None and token_id not in self._allowed(rest):
            return False
        if not self.inner.accept_token(token_id):
            return False
        start = len(self._text)
        self._lens.append(start)
        if not self._closed():
            self._text += self._all_bytes[token_id] if token_id < len(self._all_bytes) else b""
            if self._close_at < 0:
                at = self._text.find(self._close, max(len(self._open), start - len(self._close) + 1))
                self._close_at = at
        return True

    def rollback(self, num_tokens: int, /) -> None:
        self.inner.rollback(num_tokens)
        if num_tokens <= 0:
            return
        keep = self._lens[-num_tokens] if num_tokens <= len(self._lens) else 0
        del self._lens[-num_tokens:]
        del self._text[keep:]
        if self._close_at >= 0 and self._close_at + len(self._close) > len(self._text):
            self._close_at = -1

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int = 0, /) -> object:
        result = self.inner.fill_next_token_bitmask(bitmask, index)
        rest = self._rest()
        if rest is not None:
            allowed = np.zeros(self._num_words, dtype=np.uint32)
            for t in self._allowed(rest):
                if t < self._num_words * 32:
                    allowed[t >> 5] |= np.uint32(1 << (t & 31))
            row = bitmask[index].view(np.uint32)
            row &= allowed
        return result
