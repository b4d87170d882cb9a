"""Per-request grammar sessions: committed matcher state, idempotent commits, TTL eviction.

Request state lives here; engine state (compiled grammars) lives in
compiler_cache. A session is only ever touched under its own lock, so two
RPCs naming the same session serialise while different sessions run in
parallel.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from specmask.common.reasoning_section import ReasoningSection
from specmask.mask_service.auth import public_owner
from specmask.mask_service.errors import InvalidArgument, LimitExceeded, NotOwner, SessionNotFound, TokenRejected
from specmask.mask_service.grammar.json_keys import DuplicateKeyGuard, key_vocab
from specmask.mask_service.grammar.section_budget import SectionBudget
from specmask.mask_service.grammar.spellings import Spellings
from specmask.mask_service.protocols import GrammarMatcher
from specmask.mask_service.server.compiler_cache import CompiledEntry

logger = logging.getLogger(__name__)

MAX_OWNER_CHARS = 256
MAX_REQUEST_ID_CHARS = 256


@dataclass
class Session:
    session_id: str
    entry: CompiledEntry
    matcher: GrammarMatcher  # the engine's matcher, committed state between calls
    vocab_size: int
    owner: str = ""  # who holds it ("" = unnamed); see SessionStore.release_owner
    request_id: str = ""  # the orchestrator request it serves ("" = not given); named in its log lines
    last_seq: int = 0
    num_committed: int = 0
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Forced runs handed out since the last commit: (num_committed then, the drafts before the
    # run) -> the forced text it spelled. The next commit says how the target spelled it, a
    # vote in ``spellings`` and in the tokenizer's pooled table (grammar/spellings.py);
    # draft_masks reads and clears it. A sampled request spells by ``spellings`` alone, so its
    # drafts depend on its own history only (a seeded request replays).
    forced_offers: dict[tuple[int, tuple[int, ...]], bytes] = field(default_factory=dict)
    spellings: Spellings = field(default_factory=Spellings)

    @property
    def num_mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    @property
    def log_prefix(self) -> str:
        """``[request_id=...] `` for this session's log lines (the request id in
        every line; DraftMasks batches many requests, so lines about one session use this)."""
        return f"[request_id={self.request_id}] " if self.request_id else ""

    def check_tokens(self, tokens: Sequence[int], what: str) -> None:
        for t in tokens:
            if not 0 <= t < self.vocab_size:
                raise InvalidArgument(f"session {self.session_id}: {what} token {t} outside [0, {self.vocab_size})")

    def commit_locked(self, seq: int, tokens: Sequence[int]) -> bool:
        """Advance committed state. Caller holds ``lock``. Returns True if applied.

        Invariant: on any error the matcher is exactly as before the call
        (partial acceptance is rolled back), so a retry or a corrected
        request starts from the committed state.
        """
        if not tokens:
            return False
        if seq <= 0:
            raise InvalidArgument(f"session {self.session_id}: commit seq must be >= 1, got {seq}")
        if seq <= self.last_seq:
            return False  # a retried commit: already applied
        self.check_tokens(tokens, "commit")
        accepted = 0
        for t in tokens:
            if not self.matcher.accept_token(int(t)):
                if accepted:
                    self.matcher.rollback(accepted)
                raise TokenRejected(
                    f"session {self.session_id}: grammar rejects token {t} at commit position {accepted} (seq {seq})"
                )
            accepted += 1
        self.last_seq = seq
        self.num_committed += accepted
        return True


class SessionStore:
    def __init__(
        self,
        *,
        max_sessions: int,
        ttl_s: float,
        max_per_owner: int | None = None,
        memory_guard: Callable[[], str | None] | None = None,
    ) -> None:
        """``max_per_owner``: sessions one owner may hold (one client filling the
        whole store blocked every other); None = ``max_sessions``. ``memory_guard``: returns a
        reason to shed new sessions (memory near its limit), or None."""
        self._max = max_sessions
        self._max_per_owner = max_per_owner or max_sessions
        self._memory_guard = memory_guard
        self._ttl = ttl_s
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._per_owner: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._sessions)

    def count_for(self, request_ids: Collection[str]) -> int:
        """How many open sessions serve one of ``request_ids`` (for operators and tests: the
        store's total mixes in every other request)."""
        with self._lock:
            return sum(1 for s in self._sessions.values() if s.request_id in request_ids)

    def _drop_locked(self, session_id: str) -> Session | None:
        s = self._sessions.pop(session_id, None)
        if s is not None:
            self._per_owner[s.owner] -= 1
            if self._per_owner[s.owner] <= 0:
                del self._per_owner[s.owner]
        return s

    def open(
        self,
        entry: CompiledEntry,
        vocab_size: int,
        owner: str = "",
        request_id: str = "",
        section_budget: ReasoningSection | None = None,
    ) -> Session:
        """``section_budget``: the grammar's reasoning section with the request's token budget
        (``max_tokens`` > 0), enforced on this session's matcher (grammar/section_budget.py)."""
        if len(owner) > MAX_OWNER_CHARS:
            raise InvalidArgument(f"owner is {len(owner)} characters; at most {MAX_OWNER_CHARS}")
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(f"request_id is {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
        self.evict_idle()
        if self._memory_guard is not None:
            reason = self._memory_guard()
            if reason is not None:
                raise LimitExceeded(f"new sessions shed: {reason}")
        matcher = entry.backend.new_matcher(entry.compiled)
        if entry.json_keys:
            words = (vocab_size + 31) // 32
            matcher = DuplicateKeyGuard(matcher, key_vocab(entry.key[0], entry.compiled.tokenizer_info, words))
        if section_budget is not None:
            words = (vocab_size + 31) // 32
            vocab = key_vocab(entry.key[0], entry.compiled.tokenizer_info, words)
            matcher = SectionBudget(matcher, section_budget, vocab.all_bytes, vocab.by_bytes, words)
        session = Session(uuid.uuid4().hex, entry, matcher, vocab_size, owner=owner, request_id=request_id)
        with self._lock:
            if len(self._sessions) >= self._max:
                raise LimitExceeded(f"session limit {self._max} reached")
            if self._per_owner[owner] >= self._max_per_owner:
                raise LimitExceeded(
                    f"owner {owner or '(unnamed)'!s} holds {self._per_owner[owner]} sessions "
                    f"(per-owner limit {self._max_per_owner})"
                )
            self._sessions[session.session_id] = session
            self._per_owner[owner] += 1
        return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(
                f"unknown session {session_id!r} (closed, evicted after idle TTL, or another replica)"
            )
        session.last_used = time.monotonic()
        return session

    def log_prefix_of(self, session_id: str) -> str:
        """The session's ``log_prefix`` ('' when unknown); does not count as a use (no TTL refresh)."""
        with self._lock:
            s = self._sessions.get(session_id)
        return s.log_prefix if s is not None else ""

    def close(self, session_id: str, owner: str = "") -> bool:
        """Close one session; ``owner`` must be the one it was opened with (NotOwner otherwise,
        and the session stays). Returns whether it existed."""
        with self._lock:
            held = self._sessions.get(session_id)
            if held is not None and held.owner and not hmac.compare_digest(held.owner, owner):
                raise NotOwner(f"session {session_id} belongs to another owner; it stays open")
            s = self._drop_locked(session_id)
        if s is not None:
            logger.info("%ssession %s closed after %d committed tokens", s.log_prefix, session_id, s.num_committed)
        return s is not None

    def release_owner(self, owner: str) -> int:
        """Close every session opened with ``owner``; returns how many. A call in
        flight on one of them finishes on its own copy, then the session is gone."""
        if not owner:
            raise InvalidArgument("owner must be non-empty (sessions opened without one cannot be released)")
        if len(owner) > MAX_OWNER_CHARS:
            raise InvalidArgument(f"owner is {len(owner)} characters; at most {MAX_OWNER_CHARS}")
        with self._lock:
            mine = [sid for sid, s in self._sessions.items() if s.owner == owner]
            for sid in mine:
                self._drop_locked(sid)
        if mine:
            logger.info("released %d sessions of owner %s", len(mine), public_owner(owner))
        return len(mine)

    def evict_idle(self) -> int:
        """Drop sessions idle longer than the TTL; returns how many were dropped."""
        cutoff = time.monotonic() - self._ttl
        with self._lock:
            stale = [sid for sid, s in self._sessions.items() if s.last_used < cutoff and not s.lock.locked()]
            for sid in stale:
                self._drop_locked(sid)
        if stale:
            logger.info("evicted %d idle sessions (ttl %.0fs)", len(stale), self._ttl)
        return len(stale)
