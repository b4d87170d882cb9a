"""Forced continuations: the tokens the grammar forces after a state (issue 15, item 3).

After ``{"name":"Bob","`` a schema with keys name, age forces the text ``age":``;
the row allows ``a``, ``ag`` and ``age`` alike, so a one-allowed-token check never
fires there. Here the forced *text* comes from the engine (xgrammar's
``find_jump_forward_string``, llguidance's ``compute_ff_bytes``; each backend's
``forced_text(matcher)``), is tokenised canonically with the session's HF tokenizer
(no special tokens), and is checked token by token:

* the tokens' bytes must spell exactly a prefix of the text (else nothing);
* the last token is kept only when no longer token that extends it is allowed by the
  grammar at its position: the next characters could otherwise merge with it
  (``":`` before a string value is ``":"``), an ambiguous boundary;
* each token must be accepted by the matcher (the run stops at the first refusal).

A row that allows exactly one token (not a stop token) is forced too, and is
checked first: it costs one scan of a row the walk already filled.

The matcher is rolled back before returning: forced tokens never change committed
state. They are proposals only: the worker still verifies them with the target.

llguidance's own ``compute_ff_tokens`` is not used: with the ``no_forcing`` header
every grammar gets (backends_llguidance), it returns no tokens, and its tokenizer
view here is a greedy longest match, not the model's canonical BPE.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# A forced token with more grammar-checked extensions than this is dropped rather
# than checked (each check is an accept + rollback): short tokens like ``"`` have
# thousands of extensions, and a boundary that open is ambiguous anyway.
MAX_EXTENSION_CHECKS = 48
# Jump-forward rounds per call: a round that keeps every token may be followed by
# another forced run from the new state (rare; bounded so a call stays cheap).
MAX_ROUNDS = 3


@dataclass(frozen=True)
class TokenizerView:
    """What forcing needs of one (tokenizer, vocab size): canonical encoding and token bytes."""

    encode: Callable[[str], list[int]]  # canonical ids for text, no special tokens / BOS
    token_bytes: list[bytes]  # [V_tok] exact bytes of each token (xgrammar's decoded vocab)
    sorted_bytes: list[bytes]  # token bytes sorted, for prefix (extension) lookups
    sorted_ids: list[int]  # ids in the order of sorted_bytes
    stop_ids: frozenset[int]

    @classmethod
    def build(cls, hf_tokenizer: Any, tokenizer_info: Any) -> TokenizerView:
        raw = getattr(hf_tokenizer, "_tokenizer", None)  # tokenizers.Tokenizer: thread-safe encode
        if raw is not None:

            def encode(text: str) -> list[int]:
                return list(raw.encode(text, add_special_tokens=False).ids)
        else:

            def encode(text: str) -> list[int]:
                return list(hf_tokenizer.encode(text, add_special_tokens=False))

        token_bytes = [bytes(b) for b in tokenizer_info.decoded_vocab]  # slow in xgrammar: once per view
        special = {int(i) for i in tokenizer_info.special_token_ids} | {int(i) for i in tokenizer_info.stop_token_ids}
        order = sorted((b, i) for i, b in enumerate(token_bytes) if b and i not in special)
        return cls(
            encode=encode,
            token_bytes=token_bytes,
            sorted_bytes=[b for b, _ in order],
            sorted_ids=[i for _, i in order],
            stop_ids=frozenset(int(i) for i in tokenizer_info.stop_token_ids),
        )

    def extensions(self, token: int) -> list[int] | None:
        """Ids of tokens whose bytes strictly extend ``token``'s; None if more than MAX_EXTENSION_CHECKS."""
        prefix = self.token_bytes[token]
        lo = bisect.bisect_left(self.sorted_bytes, prefix)
        out: list[int] = []
        for j in range(lo, len(self.sorted_bytes)):
            b = self.sorted_bytes[j]
            if not b.startswith(prefix):
                break
            if len(b) > len(prefix):
                if len(out) == MAX_EXTENSION_CHECKS:
                    return None
                out.append(self.sorted_ids[j])
        return out


class TokenizerViews:
    """Lazily built ``TokenizerView`` per (tokenizer id, vocab size), shared by all sessions."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry  # mask_service.tokenizers.TokenizerRegistry
        self._views: dict[tuple[str, int], TokenizerView] = {}
        self._lock = threading.Lock()

    def get(self, tokenizer_id: str, tokenizer_info: Any) -> TokenizerView:
        key = (tokenizer_id, int(tokenizer_info.vocab_size))
        view = self._views.get(key)
        if view is None:
            with self._lock:
                view = self._views.get(key)
                if view is None:
                    view = TokenizerView.build(self._registry.get(tokenizer_id).hf_tokenizer, tokenizer_info)
                    self._views[key] = view
                    logger.info("forced-continuation view built for tokenizer %s (vocab %d)", *key)
        return view


def single_allowed(row: np.ndarray, vocab_size: int) -> int | None:
    """The one token ``row`` ([W] int32) allows, or None when it allows none or several."""
    words = np.flatnonzero(row)
    if len(words) != 1:
        return None
    word = int(row[words[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    token = int(words[0]) * 32 + word.bit_length() - 1
    return token if token < vocab_size else None


def _accepts_any(matcher: Any, tokens: list[int]) -> bool:
    for t in tokens:
        if matcher.accept_token(t):
            matcher.rollback(1)
            return True
    return False


def _round(matcher: Any, forced_text: Callable[[Any], str], view: TokenizerView, budget: int) -> tuple[list[int], bool]:
    """One jump-forward round from the matcher's state; accepted tokens stay accepted.

    Returns (tokens accepted, whether the whole forced text was consumed with a safe
    boundary, i.e. another round might find more)."""
    text = forced_text(matcher)
    if not text:
        return [], False
    data = text.encode("utf-8")
    tokens = view.encode(text)
    spelled = b"".join(view.token_bytes[t] if t < len(view.token_bytes) else b"\x00\xff" for t in tokens)
    if not tokens or not data.startswith(spelled):
        return [], False  # the canonical ids do not spell the forced text: propose nothing
    complete = len(spelled) == len(data)
    accepted: list[int] = []
    for i, t in enumerate(tokens[:budget]):
        if t in view.stop_ids:
            break
        if i == len(tokens) - 1 and complete:
            # The text ends inside this token's reach: keep it only when no longer
            # token that starts with it is allowed here (else the boundary is ambiguous).
            ext = view.extensions(t)
            if ext is None or _accepts_any(matcher, ext):
                return accepted, False
        if not matcher.accept_token(t):
            return accepted, False
        accepted.append(t)
        if matcher.is_terminated():
            return accepted, False
    return accepted, complete and len(accepted) == len(tokens)


def forced_continuation(
    matcher: Any,
    forced_text: Callable[[Any], str],
    view: TokenizerView,
    max_tokens: int,
    *,
    last_row: np.ndarray | None,
    vocab_size: int,
) -> list[int]:
    """Up to ``max_tokens`` tokens the grammar forces from ``matcher``'s state; the
    matcher is left exactly as it was. ``last_row`` ([W] int32): the row already filled
    for this state, if any (its single allowed token is the cheap case)."""
    out: list[int] = []
    try:
        if last_row is not None:
            only = single_allowed(last_row, vocab_size)
            if only is not None and only not in view.stop_ids and matcher.accept_token(only):
                out.append(only)
        for _ in range(MAX_ROUNDS):
            if len(out) >= max_tokens or matcher.is_terminated():
                break
            tokens, more = _round(matcher, forced_text, view, max_tokens - len(out))
            out.extend(tokens)
            if not more:
                break
    finally:
        if out:
            matcher.rollback(len(out))
    return out[:max_tokens]
