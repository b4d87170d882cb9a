"""Duplicate keys in open maps, refused while decoding (JSON grammars only).

A JSON-schema grammar with an open map (``additionalProperties`` true or a schema,
``patternProperties``) lets a key repeat: both engines match each key against a
string language, not against the keys already written. The end check
(orchestrator output_check) catches ``{"a":1,"a":2}`` and fails the request;
``DuplicateKeyGuard`` prevents it instead. It wraps an engine's matcher, follows
the JSON structure of the accepted bytes (a stack of open containers, the keys each
open object has, whether the current string is a key), rolls back with it, and:

* clears from every row the tokens whose bytes would close a key string equal
  (after decoding escapes: ``"a\\u0062"`` is ``"ab"``) to an earlier key of the
  same object, including tokens that close one and go on (``":``, ``":"``);
* refuses such a token in ``accept_token`` (drafts, commits, forced tokens).

Where the key language is bounded (``^[ab]{1,8}$``), writing an earlier key in full
can leave nothing but closing it: a dead end. A row inside a key therefore also
clears each token that spells the rest of an earlier key when the state after it is
a dead end (a look-ahead of one row fill per such token, MAX_LOOKAHEADS per row,
MAX_LOOKAHEAD_DEPTH keys deep), and ``accept_token`` refuses the same tokens.
Where the state itself is a dead end (every token the grammar allows closes a
repeated key: the key, or the decision to open one, was the mistake), the row is
left as the engine gives it and the token is accepted; an all-zero row would turn
the sampler's softmax into NaN. The end check then fails that request.

Cost: per tokenizer, the tokens holding a ``"`` byte are indexed once
(``KeyVocab``); per row only those tokens are looked at, and only the ones that
could close a key already in an open object.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from specmask.mask_service.grammar.section_budget import SectionBudget
from specmask.mask_service.protocols import GrammarMatcher

logger = logging.getLogger(__name__)

_QUOTE = 0x22
# How many keys deep a row looks ahead for dead ends (each level: one accept, one row
# fill, one rollback). Keys that are prefixes of one another chain the levels.
MAX_LOOKAHEAD_DEPTH = 4
# Look-aheads per row or accepted token at most, all depths together (each costs about
# one row fill), so a schema of keys that prefix one another cannot make a row expensive;
# past them the end check is left to catch a dead end.
MAX_LOOKAHEADS = 24
_BACKSLASH = 0x5C


def decode_key(raw: bytes) -> str | None:
    """The string a JSON key's raw bytes (between its quotes) stands for; None if not decodable."""
    if b"\\" not in raw and b'"' not in raw and (not raw or min(raw) >= 0x20):
        # No escapes, quotes or control bytes: exactly what json.loads gives (it reads such bytes
        # as UTF-8 with surrogatepass too), without its parser; the guard decodes every key a
        # row fill checks.
        try:
            return raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return None
    try:
        value = json.loads(b'"' + raw + b'"', strict=False)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, str) else None


def _segments(data: bytes, in_string: bool) -> list[str]:
    """Decoded strings that both open and close inside ``data`` (lexed from ``in_string``)."""
    out: list[str] = []
    escape = False
    start = -1  # index after the opening quote of a string begun inside data
    for i, c in enumerate(data):
        if in_string:
            if escape:
                escape = False
            elif c == _BACKSLASH:
                escape = True
            elif c == _QUOTE:
                in_string = False
                if start >= 0:
                    value = decode_key(data[start:i])
                    if value is not None:
                        out.append(value)
                start = -1
        elif c == _QUOTE:
            in_string = True
            start = i + 1
    return out


def _before_close(data: bytes) -> str | None:
    """Inside a string, the decoded text before ``data``'s first closing quote (None: no
    closing quote, or the bytes before it are not whole characters)."""
    escape = False
    for i, c in enumerate(data):
        if escape:
            escape = False
        elif c == _BACKSLASH:
            escape = True
        elif c == _QUOTE:
            return decode_key(data[:i])
    return None


def _word_mask(ids: list[int], num_words: int) -> np.ndarray:
    words = np.zeros(num_words, dtype=np.uint32)
    for t in ids:
        words[t >> 5] |= np.uint32(1 << (t & 31))
    return words.view(np.int32)


@dataclass(frozen=True)
class KeyVocab:
    """What the guard needs of one tokenizer: the bytes of tokens holding a quote, indexed."""

    all_bytes: list[bytes]  # id -> bytes of every token (b"" for special and stop tokens)
    by_bytes: dict[bytes, list[int]]  # bytes -> ids, tokens without a '"' (spelling part of a key)
    token_bytes: dict[int, bytes]  # id -> bytes, tokens holding a '"' byte only
    quote_words: np.ndarray  # [W] int32: tokens holding a '"'
    # Inside a string (no escape pending): the decoded text before the token's first
    # closing quote -> ids of the tokens that close the string after exactly that text.
    closers: dict[str, np.ndarray]
    # Per start state (0: outside a string, 1: inside one): decoded string -> ids of
    # tokens that open and close a string with that value within their bytes.
    segments: tuple[dict[str, list[int]], dict[str, list[int]]]
    self_dups: tuple[list[int], list[int]]  # tokens with one value twice among their segments

    @classmethod
    def build(cls, tokenizer_info: Any, num_words: int) -> KeyVocab:
        special = {int(i) for i in tokenizer_info.special_token_ids} | {int(i) for i in tokenizer_info.stop_token_ids}
        all_bytes = [b"" if i in special else bytes(b) for i, b in enumerate(tokenizer_info.decoded_vocab)]
        quoted = {i: b for i, b in enumerate(all_bytes) if b'"' in b and i < num_words * 32}
        segments: tuple[dict[str, list[int]], dict[str, list[int]]] = ({}, {})
        self_dups: tuple[list[int], list[int]] = ([], [])
        for t, data in quoted.items():
            if data.count(b'"') < 2:
                continue
            for parity in (0, 1):
                values = _segments(data, bool(parity))
                for v in set(values):
                    segments[parity].setdefault(v, []).append(t)
                if len(set(values)) < len(values):
                    self_dups[parity].append(t)
        closing: dict[str, list[int]] = {}
        for t, data in quoted.items():
            text = _before_close(data)
            if text is not None:
                closing.setdefault(text, []).append(t)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(all_bytes):
            if b and b'"' not in b and i < num_words * 32:
                by_bytes.setdefault(b, []).append(i)
        return cls(
            all_bytes=all_bytes,
            by_bytes=by_bytes,
            token_bytes=quoted,
            quote_words=_word_mask(list(quoted), num_words),
            closers={k: np.array(ids, dtype=np.int64) for k, ids in closing.items()},
            segments=segments,
            self_dups=self_dups,
        )


_VOCABS: dict[tuple[str, int, int], KeyVocab] = {}
_VOCABS_LOCK = threading.Lock()


def key_vocab(tokenizer_id: str, tokenizer_info: Any, num_words: int) -> KeyVocab:
    """The shared ``KeyVocab`` of a (tokenizer, vocab size), built on first use."""
    key = (tokenizer_id, int(tokenizer_info.vocab_size), num_words)
    with _VOCABS_LOCK:
        found = _VOCABS.get(key)
        if found is None:
            found = _VOCABS[key] = KeyVocab.build(tokenizer_info, num_words)
    return found


class _Object:
    __slots__ = ("expect_key", "keys")

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.expect_key = True


# Undo operations logged per accepted token.
_PUSH, _POP, _ADD, _EXPECT = 0, 1, 2, 3


class KeyTracker:
    """The JSON structure of accepted bytes, as far as keys go; rolls back token by token.

    It trusts the grammar for validity (it only reads structure): quotes, escapes,
    brackets, commas. Arrays are ``None`` on the stack.
    """

    __slots__ = ("_log", "escape", "in_string", "is_key", "key_raw", "stack")

    def __init__(self) -> None:
        self.stack: list[_Object | None] = []
        self.in_string = False
        self.is_key = False
        self.escape = 0  # 0: none; 1: after '\\'; 2..5: hex digits of \\u still to come + 1
        self.key_raw = bytearray()
        # Per fed token: (in_string, is_key, escape, key_raw, undo ops)
        self._log: list[tuple[bool, bool, int, bytes, list[tuple[Any, ...]]]] = []

    def __len__(self) -> int:
        return len(self._log)

    def feed(self, data: bytes) -> bool:
        """Advance over one token's bytes (always applied, undo with ``undo``);
        False when they close a key already in its object."""
        ops: list[tuple[Any, ...]] = []
        self._log.append((self.in_string, self.is_key, self.escape, bytes(self.key_raw), ops))
        ok = True
        stack = self.stack
        for c in data:
            if self.in_string:
                if self.escape:
                    self.escape = (5 if c == 0x75 else 0) if self.escape == 1 else self.escape - 1
                    if self.escape == 1:  # the last hex digit
                        self.escape = 0
                elif c == _BACKSLASH:
                    self.escape = 1
                elif c == _QUOTE:
                    self.in_string = False
                    if self.is_key:
                        self.is_key = False
                        key = decode_key(bytes(self.key_raw))
                        self.key_raw.clear()
                        top = stack[-1] if stack else None
                        if key is not None and top is not None:
                            if key in top.keys:
                                ok = False
                            else:
                                top.keys.add(key)
                                ops.append((_ADD, top, key))
                    continue
                if self.is_key:
                    self.key_raw.append(c)
            elif c == _QUOTE:
                self.in_string = True
                top = stack[-1] if stack else None
                self.is_key = top is not None and top.expect_key
                if self.is_key and top is not None:
                    top.expect_key = False
                    ops.append((_EXPECT, top, True))
            elif c == 0x7B:  # {
                stack.append(_Object())
                ops.append((_PUSH,))
            elif c == 0x5B:  # [
                stack.append(None)
                ops.append((_PUSH,))
            elif c in (0x7D, 0x5D):  # } ]
                if stack:
                    ops.append((_POP, stack.pop()))
            elif c == 0x2C:  # ,
                top = stack[-1] if stack else None
                if top is not None and not top.expect_key:
                    top.expect_key = True
                    ops.append((_EXPECT, top, False))
        return ok

    def undo(self, n: int = 1) -> None:
        for _ in range(n):
            self.in_string, self.is_key, self.escape, raw, ops = self._log.pop()
            self.key_raw[:] = raw
            for op in reversed(ops):
                kind = op[0]
                if kind == _PUSH:
                    self.stack.pop()
                elif kind == _POP:
                    self.stack.append(op[1])
                elif kind == _ADD:
                    op[1].keys.discard(op[2])
                else:
                    op[1].expect_key = op[2]

    def closes_repeat(self, data: bytes) -> bool:
        """Whether these bytes, from the current state, would close a repeated key (no state change)."""
        ok = self.feed(data)
        self.undo()
        return not ok

    def any_keys(self) -> bool:
        return any(f is not None and f.keys for f in self.stack)


def _ids_in(words: np.ndarray) -> np.ndarray:
    """Token ids whose bit is set in ``words`` ([W] int32)."""
    nz = np.flatnonzero(words)
    if not len(nz):
        return nz
    bits = np.unpackbits(words[nz].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    w, b = np.nonzero(bits)
    return nz[w] * 32 + b


def _allows(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _clear(row: np.ndarray, ids: list[int] | np.ndarray) -> None:
    if not len(ids):
        return
    t = np.asarray(ids, dtype=np.int64)
    keep = ~np.left_shift(np.uint32(1), (t & 31).astype(np.uint32))
    np.bitwise_and.at(row.view(np.uint32), t >> 5, keep)


class DuplicateKeyGuard:
    """A ``GrammarMatcher`` that refuses repeated keys in every JSON object (module doc)."""

    __slots__ = ("_budget", "_depth", "_tracker", "_vocab", "dead_ends", "inner")

    def __init__(self, inner: GrammarMatcher, vocab: KeyVocab) -> None:
        self.inner = inner
        self._vocab = vocab
        self._tracker = KeyTracker()
        self.dead_ends = 0  # rows left unfiltered because only repeated keys could follow
        self._depth = 0  # lookahead depth of the row being filtered
        self._budget = MAX_LOOKAHEADS  # look-aheads left to the current call

    def _bytes(self, token: int) -> bytes:
        data = self._vocab.all_bytes
        return data[token] if token < len(data) else b""

    def accept_token(self, token_id: int, /) -> bool:
        data = self._bytes(token_id)
        if self._tracker.feed(data):
            if not self.inner.accept_token(token_id):
                self._tracker.undo()
                return False
            if not self._spells_a_key():
                return True
            self.inner.rollback(1)
        self._tracker.undo()
        # A token a row may refuse (it closes a repeated key, or spells one in full): the
        # row of this state decides, so a token is accepted exactly where rows allow it.
        row = np.empty((1, self._vocab.quote_words.shape[0]), dtype=np.int32)
        self.fill_next_token_bitmask(row, 0)
        if not _allows(row[0], token_id) or not self.inner.accept_token(token_id):
            return False
        self._tracker.feed(data)
        return True

    def _spells_a_key(self) -> bool:
        """Whether the key string being written already spells a key of its object."""
        tr = self._tracker
        if not (tr.in_string and tr.is_key) or tr.escape or not tr.stack:
            return False
        top = tr.stack[-1]
        return top is not None and decode_key(bytes(tr.key_raw)) in top.keys

    def _dead_end(self) -> bool:
        """Whether every token the grammar allows here closes a repeated key (rows stay unfiltered there)."""
        row = np.empty((1, self._vocab.quote_words.shape[0]), dtype=np.int32)
        self.inner.fill_next_token_bitmask(row, 0)
        if not row[0].any():
            return False
        # Quick way out: a token without a quote that spells no earlier key keeps going.
        probe = row[0] & ~self._vocab.quote_words
        _clear(probe, self._spelled())
        if probe.any():
            return False
        self._filter(row[0])
        return not row[0].any()

    def _spelled(self) -> list[int]:
        """Inside a key string: tokens without a quote that spell the rest of an earlier key of
        its object (the key then spelled in full; the look-ahead's candidates)."""
        tr = self._tracker
        top = tr.stack[-1] if tr.stack else None
        if not (tr.in_string and tr.is_key) or tr.escape or top is None or not top.keys:
            return []
        so_far = decode_key(bytes(tr.key_raw))
        if so_far is None:
            return []
        out: list[int] = []
        for k in top.keys:
            if len(k) > len(so_far) and k.startswith(so_far):
                out.extend(self._vocab.by_bytes.get(k[len(so_far) :].encode("utf-8", "surrogatepass"), ()))
        return out

    def _leads_to_dead_end(self, token: int) -> bool:
        """Whether the state after ``token`` is a dead end (looked ahead at most
        MAX_LOOKAHEAD_DEPTH keys deep; deeper, it is taken as not dead)."""
        if self._depth >= MAX_LOOKAHEAD_DEPTH or self._budget <= 0 or not self.inner.accept_token(token):
            return False
        self._budget -= 1
        self._tracker.feed(self._bytes(token))
        self._depth += 1
        try:
            return self._dead_end()
        finally:
            self._depth -= 1
            self._tracker.undo()
            self.inner.rollback(1)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def rollback(self, num_tokens: int, /) -> None:
        self.inner.rollback(num_tokens)
        self._tracker.undo(min(num_tokens, len(self._tracker)))

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int = 0, /) -> object:
        if not self._depth:
            self._budget = MAX_LOOKAHEADS
        result = self.inner.fill_next_token_bitmask(bitmask, index)
        row = bitmask[index]
        original = row.copy() if row.any() else None
        if original is None:
            return result
        if self._filter(row) and not row.any():
            row[:] = original  # a dead end: see the module doc
            self.dead_ends += 1
        return result

    def _filter(self, row: np.ndarray) -> bool:
        """Clear the tokens of ``row`` that would close a repeated key; True if any was cleared."""
        tr = self._tracker
        v = self._vocab
        if not tr.any_keys():
            return self._clear_checked(row, [t for t in v.self_dups[1 if tr.in_string else 0] if _allows(row, t)])
        if tr.in_string and tr.escape:
            return self._clear_checked(row, _ids_in(row & v.quote_words))  # rare: check every quote token
        cleared = False
        parity = 1 if tr.in_string else 0
        candidates: set[int] = set(v.self_dups[parity])
        for frame in tr.stack:
            if frame is None or not frame.keys:
                continue
            seg = v.segments[parity]
            if len(frame.keys) <= len(seg):
                for k in frame.keys:
                    candidates.update(seg.get(k, ()))
            else:
                for value, ids in seg.items():
                    if value in frame.keys:
                        candidates.update(ids)
        if tr.in_string and tr.is_key:
            top = tr.stack[-1] if tr.stack else None
            so_far = decode_key(bytes(tr.key_raw))
            if so_far is None or (so_far and 0xD800 <= ord(so_far[-1]) <= 0xDBFF):
                # the key bytes end inside a character or a surrogate pair: check every quote token
                return self._clear_checked(row, _ids_in(row & v.quote_words))
            if top is not None:
                for k in top.keys:
                    if k.startswith(so_far):
                        closing = v.closers.get(k[len(so_far) :])
                        if closing is not None:
                            _clear(row, closing)  # exact: the text before their quote completes the key
                            cleared = True
                # A token spelling the rest of a key without closing it leads to a dead end
                # when the grammar then allows nothing but closing it (a bounded key language).
                spelled = [t for t in self._spelled() if _allows(row, t)]
                dead = [t for t in spelled if self._leads_to_dead_end(t)]
                if dead:
                    _clear(row, dead)
                    cleared = True
        allowed = [t for t in candidates if _allows(row, t)]
        return self._clear_checked(row, allowed) or cleared

    def _clear_checked(self, row: np.ndarray, ids: Any) -> bool:
        doomed = [int(t) for t in ids if self._tracker.closes_repeat(self._bytes(int(t)))]
        _clear(row, doomed)
        return bool(doomed)


def engine_matcher(matcher: Any) -> Any:
    """The engine's own matcher under its guards (engine calls such as forced bytes need it)."""
    while isinstance(matcher, (DuplicateKeyGuard, SectionBudget)):
        matcher = matcher.inner
    return matcher
