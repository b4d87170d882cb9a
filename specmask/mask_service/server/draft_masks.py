"""The hot path: k+1 bitmask rows per request, exactly as docs/design.md step 2.

For each request: commit its emitted tokens first (idempotent by seq), then
fill M_0, try d_1, fill M_1, ... stopping at the first draft the grammar
rejects or when the matcher terminates; rows past the stop stay all-ones (an
all-zero row would turn softmax into NaN). A request that asks for it
(``forced_up_to``) also gets the grammar's forced continuation where the walk
stops, also at a refused draft (forced.py; a worker's n-gram lookahead then
needs no second round trip to learn what is forced where its chain left the
grammar), computed before the rollback and undone with it. With ``forced_rows`` the
walk through the forced run also fills the row after each forced token, so a
worker that takes the run as drafts holds the rows for the positions after it
and for verification without asking for that state again.
Finally roll the matcher back, so computing masks never changes committed state.

Parallelism: requests are independent, so a batch is cut into contiguous
chunks run on a thread pool, one chunk inline on the calling thread.
xgrammar's ``fill_next_token_bitmask`` / ``accept_token`` run in C++ through
tvm-ffi, and row hashing (hashlib) releases the GIL for large buffers, so the
per-row work overlaps across cores; the per-call Python wrapper still holds the
GIL, so cheap rows gain less. bench/mask_service.py compares per-request
chunks against the serial loop and xgrammar's ``BatchGrammarMatcher`` (one
batched call per draft position, synchronising all requests at every position);
chunks win (docs/benchmarks.md, "Mask service"), and on a heavily loaded box
threads and serial tie. ``traverse_draft_tree`` was slower still in a probe (per-request
tensor set-up dominates for a linear chain) and is not used.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specmask.mask_service.errors import InternalItemError, InvalidArgument, MaskError
from specmask.mask_service.grammar.backends import ENGINES, engine_name
from specmask.mask_service.grammar.forced import (
    TokenizerView,
    TokenizerViews,
    forced_continuation,
    learn_spelling,
)
from specmask.mask_service.grammar.json_keys import engine_matcher
from specmask.mask_service.protocols import GrammarMatcher
from specmask.mask_service.server.sessions import Session, SessionStore
from specmask.mask_service.wire import InternedRow, RowInterner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftRequest:
    session_id: str
    draft_tokens: Sequence[int]
    commit_tokens: Sequence[int] = ()
    commit_seq: int = 0
    last_row_only: bool = False
    # Forced continuation where the walk stops, also at a refused draft (forced.py), filling
    # drafts up to this many in all (forced_up_to - num_grammar_accepted tokens at most); 0 = none.
    forced_up_to: int = 0
    # Also fill the row after each forced token (DraftOutcome.forced_rows).
    forced_rows: bool = False
    # Spell forced text by the votes of every session of the tokenizer (greedy requests only).
    shared_spellings: bool = False

    @property
    def num_rows(self) -> int:
        return 1 if self.last_row_only else len(self.draft_tokens) + 1

    def forced_row_capacity(self, max_k: int) -> int:
        """The most rows after forced tokens this request can get (its scratch rows past num_rows)."""
        if not self.forced_rows:
            return 0
        return min(self.forced_up_to, max_k)


@dataclass
class DraftOutcome:
    num_rows: int = 0
    num_grammar_accepted: int = 0
    terminated: bool = False
    rows: list[InternedRow | None] = field(default_factory=list)  # None = all-ones
    forced_tokens: list[int] = field(default_factory=list)  # grammar-accepted, committed state unchanged
    forced_at_stop: bool = False  # forced_tokens are for the state after num_grammar_accepted drafts
    # With DraftRequest.forced_rows: per forced token, the row after it (None = all-ones: the
    # grammar ended there); empty otherwise.
    forced_rows: list[InternedRow | None] = field(default_factory=list)
    # How many rows (a prefix) the walk's hook filled in the caller's forced-row scratch: set
    # inside the session lock, read after it (interning runs outside the lock).
    forced_rows_filled: int = 0
    error: MaskError | None = None


def walk_drafts(
    matcher: GrammarMatcher,
    drafts: Sequence[int],
    out: np.ndarray,
    last_row_only: bool,
    *,
    terminated: bool | None = None,
    at_stop: Callable[[GrammarMatcher, np.ndarray | None, int, bool], None] | None = None,
) -> tuple[int, list[bool]]:
    """Fill mask rows for one request; leave ``matcher`` as it was.

    out: [k+1, W] int32 (or [1, W] when last_row_only). Rows not filled are left
    untouched; they mean all-ones, so a caller that reads them pre-fills -1.
    ``terminated``: whether the matcher's committed state is terminated, when the
    caller already asked (saves a second engine call per request on the hot path).
    ``at_stop(matcher, row, accepted, refused)``: called, before the rollback, at the
    state where the walk stops unless that state is terminated: after every draft
    (refused False), or after the ``accepted`` drafts before the first the grammar
    refuses (refused True). ``row``: that state's filled [W] row (None when not
    filled: last_row_only with a refused draft). It must leave the matcher as it
    found it.
    Returns (number of drafts the grammar accepts, which rows were filled).
    """
    m = matcher
    k = len(drafts)
    filled = [False] * out.shape[0]
    accepted = 0
    refused = False
    stopped = m.is_terminated() if terminated is None else terminated
    if not stopped and not last_row_only:
        m.fill_next_token_bitmask(out, 0)
        filled[0] = True
    for i in range(k):
        if stopped:
            break
        if not m.accept_token(int(drafts[i])):
            stopped = refused = True
            break
        accepted += 1
        if m.is_terminated():
            stopped = True
            break
        if not last_row_only:
            m.fill_next_token_bitmask(out, i + 1)
            filled[i + 1] = True
    if last_row_only and not stopped:
        m.fill_next_token_bitmask(out, 0)
        filled[0] = True
    try:
        if at_stop is not None and (refused or not stopped):
            row = out[-1] if not stopped else (out[accepted] if not last_row_only and filled[accepted] else None)
            at_stop(m, row, accepted, refused)
    finally:  # a failing hook must not leave the drafts accepted in committed state
        if accepted:
            m.rollback(accepted)
    return accepted, filled


# Forced runs a session remembers between two commits (one per draft-side request of a step).
MAX_FORCED_OFFERS = 64
# Rows a call must give each thread before it is split over the pool (see run()).
MIN_ROWS_PER_CHUNK = 32


class DraftMaskEngine:
    def __init__(
        self,
        sessions: SessionStore,
        interner: RowInterner,
        *,
        num_threads: int,
        max_batch: int,
        max_k: int,
        tokenizers: Any = None,
    ) -> None:
        """``tokenizers``: the TokenizerRegistry, for forced continuations (None = never computed)."""
        self._sessions = sessions
        self._views = TokenizerViews(tokenizers) if tokenizers is not None else None
        self._interner = interner
        self._threads = max(1, num_threads)
        self._pool = (
            ThreadPoolExecutor(max_workers=self._threads - 1, thread_name_prefix="masks") if self._threads > 1 else None
        )
        self.max_batch = max_batch
        self.max_k = max_k
        self._local = threading.local()

    def _scratch(self, rows: int, width: int) -> np.ndarray:
        """A [rows, W] int32 buffer owned by the calling thread, contents undefined.

        Only filled rows are read (and copied out by interning before ``run``
        returns), so the buffer is reused across calls: no 2.5 MB allocation,
        page faults and -1 fill per Llama-3 batch on the hot path.
        """
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.shape[1] != width or buf.shape[0] < rows:
            buf = np.empty((1 << max(rows - 1, 0).bit_length(), width), dtype=np.int32)  # grows by doubling
            self._local.buf = buf
        return buf[:rows]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._views is not None:
            self._views.shutdown()

    @property
    def forced_views(self) -> TokenizerViews | None:
        """The per-tokenizer views forced continuations use (None: never computed)."""
        return self._views

    def warm_forced(self, tokenizer_id: str, tokenizer_info: Any) -> None:
        """Start building the forced-continuation view for a tokenizer in the background
        (OpenSession calls it), so the session's first forced request does not pay for it."""
        if self._views is not None:
            self._views.warm(tokenizer_id, tokenizer_info)

    def _one(self, req: DraftRequest, session: Session, scratch: np.ndarray) -> DraftOutcome:
        """``scratch``: [num_rows + forced row capacity, W]; the forced rows go after the walk's."""
        res = DraftOutcome()
        out, forced_out = scratch[: req.num_rows], scratch[req.num_rows :]
        try:
            with session.lock:
                base = session.num_committed
                if session.commit_locked(req.commit_seq, req.commit_tokens) and session.forced_offers:
                    self._learn_spellings(session, base, req.commit_tokens)
                session.check_tokens(req.draft_tokens, "draft")
                res.terminated = bool(session.matcher.is_terminated())
                res.num_grammar_accepted, filled = walk_drafts(
                    session.matcher,
                    req.draft_tokens,
                    out,
                    req.last_row_only,
                    terminated=res.terminated,
                    at_stop=self._forcing(req, session, res, forced_out if req.forced_rows else None),
                )
        except MaskError as exc:
            res.error = exc
            return res
        except Exception as exc:
            # An engine or walk failure in one item is that item's request's failure, never
            # the call's: the other items of the batch belong to other users.
            logger.exception("DraftMasks item for session %s failed", req.session_id)
            return DraftOutcome(error=InternalItemError(f"internal error computing masks ({type(exc).__name__})"))
        res.num_rows = out.shape[0]
        res.rows = self._interner.intern_rows(out, filled, session.num_mask_words)
        if req.forced_rows and res.forced_tokens:
            marks = [j < res.forced_rows_filled for j in range(len(res.forced_tokens))]
            res.forced_rows = self._interner.intern_rows(forced_out[: len(marks)], marks, session.num_mask_words)
        return res

    def _forcing(
        self,
        req: DraftRequest,
        session: Session,
        res: DraftOutcome,
        rows_out: np.ndarray | None,
    ) -> Callable[[GrammarMatcher, np.ndarray | None, int, bool], None] | None:
        """The walk's hook that puts the forced continuation in ``res`` (None when not asked),
        and the row after each forced token in ``rows_out`` when given (how many:
        ``res.forced_rows_filled``)."""
        if req.forced_up_to <= 0:
            return None
        view = self._view(session)
        if view is None:
            return None
        entry = session.entry
        engine_forced = ENGINES[engine_name(entry.compiled, entry.backend)].forced_bytes

        def forced_bytes(matcher: GrammarMatcher) -> bytes:
            return engine_forced(engine_matcher(matcher))

        res.forced_at_stop = True

        def hook(matcher: GrammarMatcher, row: np.ndarray | None, accepted: int, refused: bool) -> None:
            cap = min(req.forced_up_to - accepted, self.max_k)
            if cap > 0:
                run = forced_continuation(
                    matcher,
                    forced_bytes,
                    view,
                    cap,
                    last_row=row,
                    vocab_size=session.vocab_size,
                    rows_out=rows_out,
                    spellings=view.spellings if req.shared_spellings else session.spellings,
                )
                res.forced_tokens, res.forced_rows_filled = run.tokens, run.rows
                if run.text and len(session.forced_offers) < MAX_FORCED_OFFERS:
                    session.forced_offers[(session.num_committed, tuple(req.draft_tokens[:accepted]))] = run.text

        return hook

    def _view(self, session: Session) -> TokenizerView | None:
        """The forced-continuation view of the session's tokenizer (None: never computed)."""
        if self._views is None:
            return None
        entry = session.entry
        return self._views.get(entry.key[0], entry.compiled.tokenizer_info)

    def _learn_spellings(self, session: Session, base: int, committed: Sequence[int]) -> None:
        """Vote, for each forced run handed out at the state ``committed`` started from, for
        the token the target committed where the run started (grammar/spellings.py)."""
        offers, session.forced_offers = session.forced_offers, {}
        view = self._view(session)
        if view is None:
            return
        for (at, drafts), text in offers.items():
            n = len(drafts)
            if at == base and n < len(committed) and tuple(committed[:n]) == drafts:
                learn_spelling(view, text, int(committed[n]), session.spellings, view.spellings)

    def _chunk(
        self, jobs: list[tuple[int, DraftRequest, Session | MaskError, np.ndarray]], results: list[DraftOutcome]
    ) -> None:
        for idx, req, session, out in jobs:
            if isinstance(session, MaskError):
                results[idx] = DraftOutcome(error=session)
            else:
                results[idx] = self._one(req, session, out)

    def run(self, requests: Sequence[DraftRequest]) -> tuple[list[DraftOutcome], int]:
        """Compute outcomes for a batch. Returns (outcomes in request order, W).

        Batch-level problems (size, k, mixed vocab widths) raise InvalidArgument;
        per-request problems (unknown session, rejected commit) land in
        ``DraftOutcome.error`` so one bad request does not fail the others.
        """
        if len(requests) > self.max_batch:
            raise InvalidArgument(f"batch of {len(requests)} exceeds max_batch {self.max_batch}")
        sessions: list[Session | MaskError] = []
        width = 0
        for req in requests:
            if len(req.draft_tokens) > self.max_k:
                raise InvalidArgument(f"session {req.session_id}: k={len(req.draft_tokens)} exceeds max_k {self.max_k}")
            try:
                s = self._sessions.get(req.session_id)
            except MaskError as exc:
                sessions.append(exc)
                continue
            if width and s.num_mask_words != width:
                raise InvalidArgument("all sessions in one DraftMasks call must share a vocab width")
            width = s.num_mask_words
            sessions.append(s)
        # Per request: its walk's rows, then room for the rows after its forced tokens.
        sizes = [r.num_rows + r.forced_row_capacity(self.max_k) for r in requests]
        total = sum(sizes)
        buf = self._scratch(total, max(width, 1))  # [rows_total, W]
        jobs: list[tuple[int, DraftRequest, Session | MaskError, np.ndarray]] = []
        offset = 0
        for i, (req, target, size) in enumerate(zip(requests, sessions, sizes)):
            jobs.append((i, req, target, buf[offset : offset + size]))
            offset += size
        results: list[DraftOutcome] = [DraftOutcome()] * len(requests)
        # A chunk on another thread is worth its hop only with enough rows: on a 2-core host
        # shared with a client, splitting cost more than it saved up to ~80 rows a call
        # (bench.mask_service with a row count per call), and the serving path's calls
        # are mostly smaller still (draft-side calls ask one row per sequence).
        n_chunks = min(self._threads, len(jobs), max(1, total // MIN_ROWS_PER_CHUNK))
        if n_chunks <= 1 or self._pool is None:
            self._chunk(jobs, results)
        else:
            # Balance by rows, not by requests: k varies per request.
            bounds = np.searchsorted(
                np.cumsum([j[3].shape[0] for j in jobs]), np.linspace(0, total, n_chunks + 1)[1:-1], side="left"
            )
            pieces = np.split(np.arange(len(jobs)), bounds + 1)
            futs = [self._pool.submit(self._chunk, [jobs[j] for j in p], results) for p in pieces[1:] if len(p)]
            self._chunk([jobs[j] for j in pieces[0]], results)
            for f in futs:
                f.result()
        return results, width
