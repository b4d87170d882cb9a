"""Incremental detokenization: a growing list of token ids in, text deltas out.

Decoding each new token on its own is wrong in two ways: a multi-byte UTF-8
character can span several byte-level BPE tokens (decoding one half gives
U+FFFD), and SentencePiece-style decoders treat a leading "▁" differently at
the start of a string than in the middle. So, as vLLM's incremental
detokenizer does, we decode a small window twice — ``ids[prefix:read]`` and
``ids[prefix:]`` — and emit the difference, holding text back while it ends in
an incomplete character.

For a ``tokenizers.Tokenizer`` the pushes go through the library's own
``DecodeStream``, the same two-window algorithm in Rust (one decode per push, the
prefix's text cached): it emits exactly the deltas the window code below emits
(tests/orchestrator/test_detokenizer_stream.py), at a fraction of the cost. The
window offsets are kept in step with it, because ``flush`` and ``peek`` (which the
stream lacks) and any decoder that is not a ``tokenizers.Tokenizer`` use the
window code.

The stream refuses a push whose text rewrites what it already emitted
(``InvalidPrefix``): SentencePiece's ``ByteFallback`` turns a whole run of byte
pieces into U+FFFDs once the run holds an invalid UTF-8 sequence, earlier valid
characters of the run included, so no delta can be right. The window code takes
over from there, as before the stream existed: it slices by length, and the
output stays what this module always returned.

Invariant: the concatenation of every delta returned by ``push`` and the final
``flush`` equals ``tokenizer.decode(all_ids)`` for byte-level tokenizers, and for
byte-fallback ones as long as every run of byte pieces is valid UTF-8; the
window always starts at an offset where the text decoded cleanly, i.e. at a
character boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# What a decoder emits for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """The slice of ``tokenizers.Tokenizer`` used here."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class StreamSource:
    """How a decoder's ``decode(ids, skip_special_tokens)`` is a ``tokenizers.Tokenizer``'s: the
    ids without ``drop``, decoded by ``tokenizer`` with ``skip_special_tokens`` (a decoder that
    keeps some special tokens drops the others itself and decodes the rest unskipped)."""

    tokenizer: Tokenizer
    skip_special_tokens: bool
    drop: frozenset[int] = frozenset()


@runtime_checkable
class StreamableDecoder(Decoder, Protocol):
    """A ``Decoder`` wrapping a ``tokenizers.Tokenizer`` that says how to stream its decode
    (``kept_tokens.KeepingDecoder``)."""

    def stream_source(self, skip_special_tokens: bool) -> StreamSource | None: ...


def stream_source(decoder: Decoder, skip_special_tokens: bool) -> StreamSource | None:
    """How ``decoder`` streams through ``DecodeStream``; None when it cannot (any other decoder)."""
    if isinstance(decoder, Tokenizer):
        return StreamSource(decoder, skip_special_tokens)
    if isinstance(decoder, StreamableDecoder):
        return decoder.stream_source(skip_special_tokens)
    return None


class _Stream:
    """A ``DecodeStream`` over a ``StreamSource``: ``step`` returns the text a push completes."""

    def __init__(self, source: StreamSource) -> None:
        self._tokenizer = source.tokenizer
        self._drop = source.drop
        self._stream = DecodeStream(skip_special_tokens=source.skip_special_tokens)

    def step(self, ids: Sequence[int]) -> str | None:
        """The text ``ids`` complete; None when they complete none (the window does not move)."""
        if len(ids) == 1:
            # One id is the common push (a step's single token; logprobs push one at a time), and
            # the binding steps an int at about half the cost of a one-element list.
            (token,) = ids
            return None if token in self._drop else self._stream.step(self._tokenizer, token)
        kept = [i for i in ids if i not in self._drop] if self._drop else list(ids)
        # Dropped ids decode to nothing: pushing only those moves nothing, as in the window code.
        return self._stream.step(self._tokenizer, kept) if kept else None


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
        source = stream_source(tokenizer, skip_special_tokens)
        self._stream: _Stream | None = None if source is None else _Stream(source)

    @property
    def streams(self) -> bool:
        """Whether pushes go through ``DecodeStream`` (False: the window code decodes them)."""
        return self._stream is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special_tokens)

    def _advance(self) -> None:
        """The window moves past text just emitted: it starts where the last emitted text did."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    def _delta(self, *, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            # An incomplete character: wait for the token(s) that finish it.
            return ""
        self._advance()
        return new_text[len(prefix_text) :]

    def push(self, new_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete (may be "")."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        if self._stream is not None:
            try:
                piece = self._stream.step(new_ids)
            except Exception:
                # The stream refused the push (its text rewrites emitted text, see the module
                # docstring) or the ids (the window code's decode raises the same error): the
                # window code, whose offsets are in step, decodes this push and every later one.
                self._stream = None
            else:
                if piece is None:
                    return ""
                self._advance()
                return piece
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end of generation: emit what is left, incomplete characters included."""
        if self._read_offset == len(self._ids):
            return ""
        read = self._read_offset
        tail = self._delta(final=True)
        if self._read_offset != read:
            # The window moved past text the stream still holds: later pushes (none in a
            # request's life; the state allows them) go through the window code.
            self._stream = None
        return tail

    def peek(self, extra_ids: Sequence[int] = ()) -> str:
        """What ``push(extra_ids)`` then ``flush()`` would return, without changing the state
        (a stop token's end check needs the text before deciding whether the token ends it)."""
        ids = self._ids + list(extra_ids)
        if self._read_offset == len(ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
