"""Incremental detokenization: a growing list of token ids in, text deltas out.

Decoding each new token on its own is wrong in two ways: a multi-byte UTF-8
character can span several byte-level BPE tokens (decoding one half gives
U+FFFD), and SentencePiece-style decoders treat a leading "▁" differently at
the start of a string than in the middle. So, as vLLM's incremental
detokenizer does, we decode a small window twice — ``ids[prefix:read]`` and
``ids[prefix:]`` — and emit the difference, holding text back while it ends in
an incomplete character.

Invariant: the concatenation of every delta returned by ``push`` and the final
``flush`` equals ``tokenizer.decode(all_ids)`` for byte-level tokenizers; the
window always starts at an offset where the text decoded cleanly, i.e. at a
character boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# What a decoder emits for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """The slice of ``tokenizers.Tokenizer`` used here."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Per-request detokenizer state. Not thread-safe; one per request."""

    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        # ids[:read_offset] have been turned into emitted text; the window
        # decoded each time starts at prefix_offset (a clean boundary).
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special_tokens)

    def _delta(self, *, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            # An incomplete character: wait for the token(s) that finish it.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def push(self, new_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete (may be "")."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end of generation: emit what is left, incomplete characters included."""
        if self._read_offset == len(self._ids):
            return ""
        return self._delta(final=True)

    def peek(self, extra_ids: Sequence[int] = ()) -> str:
        """What ``push(extra_ids)`` then ``flush()`` would return, without changing the state
        (a stop token's end check needs the text before deciding whether the token ends it)."""
        ids = self._ids + list(extra_ids)
        if self._read_offset == len(ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
