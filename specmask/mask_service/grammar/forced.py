"""Forced continuations: the tokens the grammar forces after a state (a speculation shortcut).

After ``{"name":"Bob","`` a schema with keys name, age forces the text ``age":``;
the row allows ``a``, ``ag`` and ``age`` alike, so a one-allowed-token check never
fires there. Here the forced *bytes* come from the engine (xgrammar's
``find_jump_forward_string``, llguidance's ``compute_ff_bytes``; each backend's
``forced_bytes(matcher)``). They may begin inside a UTF-8 character (the committed
tokens ended between its bytes) and end inside one (only a lead byte is forced), so
the walk works in bytes: the bytes finishing a begun character are spelled with
vocabulary tokens, the whole characters after them are tokenised canonically with
the session's HF tokenizer (no special tokens), a character only begun is left out,
and the tokens are checked one by one:

* the tokens' bytes must spell exactly a prefix of the text (else nothing);
* the last token is kept only when no longer token that extends it is allowed by the
  grammar at its position: the next characters could otherwise merge with it
  (``":`` before a string value is ``":"``), an ambiguous boundary;
* each token must be accepted by the matcher (the run stops at the first refusal).

A row that allows exactly one token (not a stop token) is forced too, and is
checked first: it costs one scan of a row the walk already filled.

Where the target was seen to spell a forced text differently from the canonical
encoding (``spellings.py``: votes learned from the commits that follow each run),
``spell_forced`` starts that text with the target's token and spells the rest
afresh; the checks below apply to the result unchanged.

With ``rows_out`` the row after each forced token is filled on the way, before the
rollback: the rows a walk with the run as drafts fills, so a worker taking the run
needs no request for those states.

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
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specmask.mask_service.grammar.spellings import Spellings

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
    by_bytes: dict[bytes, int]  # token bytes -> id (non-special tokens; the lowest id of duplicates)
    # Spelling votes pooled over every session of this tokenizer (spellings.py), for greedy requests.
    spellings: Spellings = field(default_factory=Spellings, compare=False)

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
            by_bytes={b: i for b, i in reversed(order)},
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
    """``TokenizerView`` per (tokenizer id, vocab size), built once and shared by all sessions.

    Building one walks the whole vocabulary (a large one such as Llama-3's takes
    far longer than a request should wait), so it is started off the request path with
    ``warm`` when a session opens for a (tokenizer, vocab size) pair (OpenSession),
    on one background thread; ``get`` on the request path then finds it built, or
    waits only for the rest of that one build. Each key is built exactly once, and
    a build never holds up ``get`` for another key.
    """

    def __init__(self, registry: Any) -> None:
        self._registry = registry  # mask_service.tokenizers.TokenizerRegistry
        self._views: dict[tuple[str, int], TokenizerView] = {}  # built
        self._building: dict[tuple[str, int], Future[TokenizerView]] = {}  # being built
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # the background builder, made on the first warm()
        self.builds = 0  # views built (tests)

    def get(self, tokenizer_id: str, tokenizer_info: Any) -> TokenizerView:
        """The view, built here if nobody started it (raises what the build raised)."""
        key = (tokenizer_id, int(tokenizer_info.vocab_size))
        view = self._views.get(key)
        if view is not None:
            return view
        future, mine = self._claim(key)
        if mine:
            self._build(key, tokenizer_info, future)
        return future.result()

    def warm(self, tokenizer_id: str, tokenizer_info: Any) -> Future[TokenizerView] | None:
        """Start building the view on the background thread and return at once; None when it
        is already built. The returned future is the build's (tests wait on it)."""
        key = (tokenizer_id, int(tokenizer_info.vocab_size))
        if key in self._views:
            return None
        future, mine = self._claim(key)
        if mine:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forced-views")
                pool = self._pool
            pool.submit(self._build, key, tokenizer_info, future)
        return future

    def _claim(self, key: tuple[str, int]) -> tuple[Future[TokenizerView], bool]:
        """(the key's build future, whether the caller must run the build)."""
        with self._lock:
            view = self._views.get(key)
            if view is not None:
                done: Future[TokenizerView] = Future()
                done.set_result(view)
                return done, False
            future = self._building.get(key)
            if future is not None:
                return future, False
            future = self._building[key] = Future()
            return future, True

    def _build(self, key: tuple[str, int], tokenizer_info: Any, future: Future[TokenizerView]) -> None:
        t0 = time.perf_counter()
        try:
            view = TokenizerView.build(self._registry.get(key[0]).hf_tokenizer, tokenizer_info)
        except BaseException as exc:
            with self._lock:
                del self._building[key]  # a later call tries again
            future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        with self._lock:
            self._views[key] = view
            del self._building[key]
            self.builds += 1
        future.set_result(view)
        logger.info(
            "forced-continuation view built for tokenizer %s (vocab %d) in %.2f s", *key, time.perf_counter() - t0
        )

    def shutdown(self) -> None:
        """Stop the background builder (a build in progress finishes)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)  # not cancel_futures: a get() may be waiting on a queued build


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


def _utf8_lead(data: bytes) -> int:
    """How many bytes ``data`` starts with that continue a character begun before it (0..3)."""
    n = 0
    while n < min(3, len(data)) and 0x80 <= data[n] <= 0xBF:
        n += 1
    return n


def _utf8_whole(data: bytes) -> int:
    """Length of the longest prefix of ``data`` made of whole UTF-8 characters."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return cut
    return 0


def tokenise_forced(data: bytes, view: TokenizerView) -> tuple[list[int], int]:
    """Whole tokens spelling a prefix of the forced bytes ``data``, and that prefix's length.

    Bytes that finish a character the committed tokens began are spelled with the
    longest vocabulary tokens that match them (a byte-level vocabulary has one per
    byte); the whole characters after them with the canonical encoding; a character
    the forced bytes only begin is left out (its next bytes are not forced, and a
    token that ends inside it would be a guess at the boundary)."""
    lead = _utf8_lead(data)
    tokens: list[int] = []
    pos = 0
    while pos < lead:
        for end in range(lead, pos, -1):
            t = view.by_bytes.get(data[pos:end])
            if t is not None:
                tokens.append(t)
                pos = end
                break
        else:
            return [], 0
    whole = _utf8_whole(data[lead:])
    if whole:
        tokens.extend(view.encode(data[lead : lead + whole].decode("utf-8")))
    return tokens, lead + whole


def spell_forced(data: bytes, view: TokenizerView, spellings: Spellings | None) -> tuple[list[int], int]:
    """``tokenise_forced`` with the spellings the model was seen to use (spellings.py): where
    the canonical spelling has a token the votes replace, that token is spelled with the
    winner instead (when the winner's bytes start there and fit), and the text after it is
    spelled afresh the same way. Returns (tokens, bytes of ``data`` they spell)."""
    tokens, covered = tokenise_forced(data, view)
    if not spellings:
        return tokens, covered
    out: list[int] = []
    pos = 0  # bytes of data spelled by out
    while tokens:
        swap = next(((i, p) for i, t in enumerate(tokens) if (p := spellings.preferred(t)) is not None), None)
        if swap is None:
            break
        i, winner = swap
        start = pos + sum(len(view.token_bytes[t]) for t in tokens[:i])
        spelled = view.token_bytes[winner] if winner < len(view.token_bytes) else b""
        if not spelled or not data.startswith(spelled, start) or start + len(spelled) > pos + covered:
            break  # the winner does not spell the text here: keep the canonical tokens
        out += [*tokens[:i], winner]
        pos = start + len(spelled)
        tokens, covered = tokenise_forced(data[pos:], view)  # each pass spells >= 1 more byte
    return out + tokens, pos + covered


def _round(
    matcher: Any,
    forced_bytes: Callable[[Any], bytes],
    view: TokenizerView,
    budget: int,
    rows: _Rows,
    spellings: Spellings | None,
) -> tuple[list[int], bool]:
    """One jump-forward round from the matcher's state; accepted tokens stay accepted
    (and ``rows`` gets the row after each).

    Returns (tokens accepted, whether the whole forced text was consumed with a safe
    boundary, i.e. another round might find more)."""
    data = forced_bytes(matcher)
    if not data:
        return [], False
    rows.text = rows.text or data  # the first round's forced text: what the run is judged by
    tokens, covered = spell_forced(data, view, spellings)
    spelled = b"".join(view.token_bytes[t] if t < len(view.token_bytes) else b"\x00\xff" for t in tokens)
    if not tokens or spelled != data[:covered]:
        return [], False  # the tokens do not spell the forced bytes: propose nothing
    complete = covered == len(data)
    accepted: list[int] = []
    for i, t in enumerate(tokens[:budget]):
        if t in view.stop_ids:
            break
        if i == len(tokens) - 1:
            # The forced bytes end inside this token's reach: keep it only when no longer
            # token that starts with it is allowed here (else the boundary is ambiguous).
            ext = view.extensions(t)
            if ext is None or _accepts_any(matcher, ext):
                return accepted, False
        if not matcher.accept_token(t):
            return accepted, False
        accepted.append(t)
        if matcher.is_terminated():
            return accepted, False
        rows.fill(matcher)
    return accepted, complete and len(accepted) == len(tokens)


class _Rows:
    """Fills the mask row after each forced token into ``out`` (when given), in order."""

    def __init__(self, out: np.ndarray | None) -> None:
        self.out = out
        self.filled = 0
        self.text = b""  # the forced bytes of the run's first round (b"" if none ran)

    def fill(self, matcher: Any) -> None:
        if self.out is not None:
            matcher.fill_next_token_bitmask(self.out, self.filled)
            self.filled += 1


@dataclass(frozen=True)
class ForcedRun:
    """What ``forced_continuation`` found."""

    tokens: list[int]  # grammar-accepted, in order
    rows: int  # rows of rows_out filled: a prefix, len(tokens) or one fewer
    # The forced text the run spells from its first token, when that token was spelled from
    # it (not a row's single allowed token): what the next commit is compared with to learn
    # the model's spelling (spellings.py). b"" otherwise.
    text: bytes = b""


def forced_continuation(
    matcher: Any,
    forced_bytes: Callable[[Any], bytes],
    view: TokenizerView,
    max_tokens: int,
    *,
    last_row: np.ndarray | None,
    vocab_size: int,
    rows_out: np.ndarray | None = None,
    spellings: Spellings | None = None,
) -> ForcedRun:
    """Up to ``max_tokens`` tokens the grammar forces from ``matcher``'s state; the
    matcher is left exactly as it was. ``last_row`` ([W] int32): the row already filled
    for this state, if any (its single allowed token is the cheap case).

    ``rows_out`` ([>= max_tokens, W] int32), when given, gets row j = the mask after the
    first j + 1 tokens, exactly as ``walk_drafts`` would fill it with the tokens as
    drafts; the state after a token that ends the grammar gets no row (walk_drafts
    leaves it unfilled: all-ones). ``spellings``: the session's learned spellings of forced
    text (spellings.py), None for the canonical ones."""
    out: list[int] = []
    rows = _Rows(rows_out)
    single = False
    try:
        if last_row is not None and max_tokens > 0:
            only = single_allowed(last_row, vocab_size)
            if only is not None and only not in view.stop_ids and matcher.accept_token(only):
                out.append(only)
                single = True
                if not matcher.is_terminated():
                    rows.fill(matcher)
        for _ in range(MAX_ROUNDS):
            if len(out) >= max_tokens or matcher.is_terminated():
                break
            tokens, more = _round(matcher, forced_bytes, view, max_tokens - len(out), rows, spellings)
            out.extend(tokens)
            if not more:
                break
    finally:
        if out:
            matcher.rollback(len(out))
    return ForcedRun(out, rows.filled, b"" if single or not out else rows.text)


def learn_spelling(view: TokenizerView, text: bytes, committed: int, *tables: Spellings) -> None:
    """The target committed ``committed`` where a forced run spelling ``text`` started: a vote
    in each of ``tables`` for how the model spells that text, when ``committed`` spells a
    prefix of it."""
    spelled = view.token_bytes[committed] if 0 <= committed < len(view.token_bytes) else b""
    if not spelled or not text.startswith(spelled):
        return  # a token reaching past the forced text says nothing about how the text is spelled
    canonical, _ = tokenise_forced(text, view)
    if canonical:
        for spellings in tables:
            spellings.vote(canonical[0], committed)
