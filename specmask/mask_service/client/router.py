"""Spread sessions over mask-service replicas, and survive losing one.

Sessions are placed by rendezvous (highest-random-weight) hashing of the
router's own session id over the live replicas, so placement is stable and
adding a replica moves only new sessions. The router keeps, per session, the
grammar spec and every committed token; when a replica is unreachable
(UNAVAILABLE / DEADLINE_EXCEEDED after the client's own retries) or answers
NOT_FOUND for a session it should hold (restart, TTL), the router reopens the
session on a live replica, replays the committed tokens as one commit, and
retries the call. This is correct because mask-service state is a pure
function of (grammar, committed tokens) and commits are idempotent by seq.

Targets are ``host:port`` replicas or ``dns:///name:port`` sets of them
(mask_service.replicas: e.g. a headless Service, one address per ready pod,
looked up again every few seconds); clients are made per resolved address on
first use.

Errors leave with the router's session ids only: a replica's session id means
nothing to the caller (and changes on failover), so ``MaskServiceError.session_id``
is translated back, or cleared when the failure concerns no one session.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import grpc

from specmask.common.grammar_spec import GrammarSpec
from specmask.mask_service.auth import public_owner
from specmask.mask_service.client.mask_client import (
    DEFAULT_COMPILE_WAIT_S,
    DraftMaskItem,
    DraftMaskOutcome,
    DraftMaskResult,
    MaskServiceClient,
    MaskServiceError,
    all_or_raise,
)
from specmask.mask_service.client.replicas import ReplicaSet
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb

logger = logging.getLogger(__name__)

_FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# A replica that failed is skipped for new placements for this long, then tried again.
DEAD_REPLICA_COOLDOWN_S = 5.0
# Concurrent per-replica calls of one batch.
_MAX_FANOUT = 8


@dataclass
class _SessionRecord:
    tokenizer_id: str
    spec: GrammarSpec
    vocab_size: int | None
    request_id: str = ""  # the orchestrator request it serves, sent again on every (re)open
    # The stop tokens the first replica's grammar ends on: the caller stops on them (a grammar
    # is over once one is taken), so a replica the session moves to must end it on the same.
    stop_token_ids: tuple[int, ...] | None = None
    address: str = ""
    remote_id: str = ""
    committed: list[int] = field(default_factory=list)
    last_seq: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _weight(session_id: str, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session_id}|{address}".encode(), digest_size=8).digest(), "little")


class MaskRouter:
    """Same method surface as MaskServiceClient; session ids are the router's own."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        deadline_s: float = 5.0,
        max_retries: int = 1,
        owner: str = "",
        compile_wait_s: float = DEFAULT_COMPILE_WAIT_S,
    ) -> None:
        """``owner``: tags every session this router opens, on any replica (see release_owner).
        ``compile_wait_s``: how long ValidateGrammar / OpenSession wait for a grammar's compile."""
        if not addresses:
            raise ValueError("MaskRouter needs at least one address")
        self.owner = owner
        self._replicas = ReplicaSet(addresses)
        self._deadline_s = deadline_s
        self._compile_wait_s = compile_wait_s
        self._max_retries = max_retries
        self._clients: dict[str, MaskServiceClient] = {}  # every address used so far
        self._dead_until: dict[str, float] = {}
        self._sessions: dict[str, _SessionRecord] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=_MAX_FANOUT, thread_name_prefix="router")

    def _client(self, address: str) -> MaskServiceClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = MaskServiceClient(
                    address,
                    deadline_s=self._deadline_s,
                    max_retries=self._max_retries,
                    compile_wait_s=self._compile_wait_s,
                )
                self._clients[address] = client
            return client

    # -- placement ----------------------------------------------------------
    def _live(self) -> list[str]:
        now = time.monotonic()
        current = self._replicas.addresses()
        if not current:  # a DNS set that resolved to nothing (yet): look again, soon
            self._replicas.refresh()
        live = [a for a in current if self._dead_until.get(a, 0.0) <= now]
        return live or current  # all marked dead: try them all again

    def _attempts(self) -> int:
        """Failovers one call may go through: one per replica, at least one."""
        return max(1, len(self._replicas.addresses()))

    def _mark_dead(self, address: str) -> None:
        logger.warning("mask replica %s unreachable; failing over", address)
        self._dead_until[address] = time.monotonic() + DEAD_REPLICA_COOLDOWN_S
        self._replicas.refresh()  # a pod that left is dropped from a DNS set sooner

    def _ranked(self, key: str, addresses: Sequence[str] | None = None) -> list[str]:
        """``addresses`` (default: the live replicas) in ``key``'s placement order."""
        return sorted(self._live() if addresses is None else addresses, key=lambda a: _weight(key, a), reverse=True)

    def _candidates(self, key: str, avoid: str | None = None) -> Iterator[str]:
        """Replicas to try for ``key``, each once, best first: the live ones (but ``avoid``,
        unless it is the only one), then, once every one has failed, those a DNS lookup made
        now adds. The periodic lookup runs every 10 s, so a router that last looked while only
        one pod was ready would otherwise fail every call once that pod dies, though the name
        already answers another (seen as "no mask-service replica reachable" naming the dead pod)."""
        ranked = self._ranked(key)
        tried = {avoid} if avoid is not None and len(ranked) > 1 else set()
        while ranked:
            for address in ranked:
                if address not in tried:
                    tried.add(address)
                    yield address
            if not self._replicas.has_dns:
                return
            ranked = self._ranked(key, [a for a in self._replicas.resolve_now() if a not in tried])

    def _record(self, session_id: str) -> _SessionRecord:
        rec = self._sessions.get(session_id)
        if rec is None:
            raise MaskServiceError(grpc.StatusCode.NOT_FOUND, f"unknown router session {session_id!r}", session_id)
        return rec

    def _place(self, session_id: str, rec: _SessionRecord, avoid: str | None = None) -> pb.OpenSessionResponse:
        """(Re)open the session on the best live replica and replay its committed tokens;
        returns that replica's answer to the open (its session id, not the router's)."""
        last_exc: MaskServiceError | None = None
        for address in self._candidates(session_id, avoid):
            client = self._client(address)
            try:
                info = client.open_session_info(
                    rec.tokenizer_id, rec.spec, rec.vocab_size, owner=self.owner, request_id=rec.request_id
                )
                remote = info.session_id
                stops = tuple(sorted(info.stop_token_ids))
                if rec.stop_token_ids is not None and stops != rec.stop_token_ids:
                    with contextlib.suppress(MaskServiceError):  # else the replica's TTL reclaims it
                        client.close_session(remote, owner=self.owner)
                    raise MaskServiceError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"replica {address} ends this grammar on stop tokens {list(stops)}, "
                        f"the session was opened with {list(rec.stop_token_ids)}",
                        session_id,
                    )
                if rec.committed:
                    client.commit(remote, rec.last_seq, rec.committed)
            except MaskServiceError as exc:
                if exc.code in _FAILOVER_CODES:
                    self._mark_dead(address)
                    last_exc = exc
                    continue
                raise
            if rec.remote_id:
                logger.info(
                    "session %s moved %s -> %s (%d tokens replayed)",
                    session_id,
                    rec.address,
                    address,
                    len(rec.committed),
                )
            rec.address, rec.remote_id, rec.stop_token_ids = address, remote, stops
            return info
        raise last_exc or MaskServiceError(grpc.StatusCode.UNAVAILABLE, "no mask-service replica reachable")

    # -- API ----------------------------------------------------------------
    def validate_grammar(
        self, tokenizer_id: str, spec: GrammarSpec, vocab_size: int | None = None, *, client: str = ""
    ) -> pb.ValidateGrammarResponse:
        for address in self._candidates(spec.cache_key()):
            try:
                return self._client(address).validate_grammar(tokenizer_id, spec, vocab_size, client=client)
            except MaskServiceError as exc:
                if exc.code not in _FAILOVER_CODES:
                    raise
                self._mark_dead(address)
        raise MaskServiceError(grpc.StatusCode.UNAVAILABLE, "no mask-service replica reachable")

    def open_session(
        self, tokenizer_id: str, spec: GrammarSpec, vocab_size: int | None = None, *, request_id: str = ""
    ) -> str:
        return self.open_session_info(tokenizer_id, spec, vocab_size, request_id=request_id).session_id

    def open_session_info(
        self, tokenizer_id: str, spec: GrammarSpec, vocab_size: int | None = None, *, request_id: str = ""
    ) -> pb.OpenSessionResponse:
        """The replica's answer to the open (width, the stop tokens the grammar ends on), with
        the router's session id. A replica the session later moves to must end the grammar on
        the same stop tokens (``_place`` refuses one that does not)."""
        session_id = uuid.uuid4().hex
        rec = _SessionRecord(tokenizer_id, spec, vocab_size, request_id)
        try:
            info = self._place(session_id, rec)
        except MaskServiceError as exc:
            exc.session_id = None  # the id was never handed out: there is nothing to attribute to
            raise
        with self._lock:
            self._sessions[session_id] = rec
        out = pb.OpenSessionResponse()
        out.CopyFrom(info)
        out.session_id = session_id
        return out

    def _recover(self, session_id: str, rec: _SessionRecord, exc: MaskServiceError) -> None:
        failed = rec.address
        if exc.code in _FAILOVER_CODES:
            self._mark_dead(failed)
            self._place(session_id, rec, avoid=failed)
        else:  # NOT_FOUND: the replica lost it (restart/TTL); reopen wherever hashing says
            self._place(session_id, rec)

    def commit(self, session_id: str, seq: int, tokens: Sequence[int]) -> bool:
        rec = self._record(session_id)
        with rec.lock:
            try:
                attempts = self._attempts()
                for attempt in range(attempts + 1):
                    try:
                        terminated = self._client(rec.address).commit(rec.remote_id, seq, tokens)
                        break
                    except MaskServiceError as exc:
                        if attempt == attempts or exc.code not in (
                            *_FAILOVER_CODES,
                            grpc.StatusCode.NOT_FOUND,
                        ):
                            raise
                        self._recover(session_id, rec, exc)
            except MaskServiceError as exc:
                # Whatever failed (the commit, or reopening/replaying on another
                # replica), it failed for this one session.
                exc.session_id = session_id
                raise
            if tokens and seq > rec.last_seq:
                rec.committed.extend(int(t) for t in tokens)
                rec.last_seq = seq
            return terminated

    def draft_masks(self, items: Sequence[DraftMaskItem]) -> list[DraftMaskResult]:
        """Like MaskServiceClient.draft_masks: every item's rows, or the first failed item's
        error raised, naming its router session id."""
        return all_or_raise(self.draft_mask_items(items))

    def draft_mask_items(self, items: Sequence[DraftMaskItem]) -> list[DraftMaskOutcome]:
        """Like MaskServiceClient.draft_mask_items: per item, its rows or its own error, which
        names the router session id. A session a replica lost (NOT_FOUND: restart, TTL) is
        reopened and replayed, and its item asked again; a replica that cannot be reached
        moves its sessions to another. Raises MaskServiceError (naming no session) only when
        the call as a whole fails: no replica reachable, or a batch-level refusal."""
        outcomes: list[DraftMaskOutcome | None] = [None] * len(items)
        placed: dict[int, _SessionRecord] = {}  # item -> its session's record
        for i, it in enumerate(items):
            try:
                placed[i] = self._record(it.session_id)
            except MaskServiceError as exc:  # a session this router does not hold: that item's failure
                outcomes[i] = exc
        pending = list(placed)
        attempts = self._attempts()
        for attempt in range(attempts + 2):
            if not pending:
                break
            last = attempt == attempts + 1
            groups: dict[str, list[int]] = {}
            for i in pending:
                groups.setdefault(placed[i].address, []).append(i)
            futs = self._run_groups(groups, items, placed)
            pending = []
            for address, fut in futs.items():
                try:
                    answers = fut.result()
                except MaskServiceError as exc:
                    # The call itself failed: move the group's sessions, or give the batch up.
                    retryable = exc.code in _FAILOVER_CODES or exc.code == grpc.StatusCode.NOT_FOUND
                    if not retryable or last:
                        raise
                    lost = [(i, exc) for i in groups[address]]
                else:
                    lost = []
                    for i, out in zip(groups[address], answers):
                        if isinstance(out, MaskServiceError) and out.code == grpc.StatusCode.NOT_FOUND and not last:
                            lost.append((i, out))  # the replica lost the session: reopen it, ask again
                        else:
                            outcomes[i] = out
                for i, why in sorted(lost, key=lambda lost_item: items[lost_item[0]].session_id):
                    rec = placed[i]
                    with rec.lock:
                        if rec.address == address:
                            try:
                                self._recover(items[i].session_id, rec, why)
                            except MaskServiceError as place_exc:
                                # No replica reachable is the whole batch's failure; anything
                                # else (e.g. the replay refused) is this session's.
                                if place_exc.code in _FAILOVER_CODES:
                                    place_exc.session_id = None
                                    raise
                                place_exc.session_id = items[i].session_id
                                outcomes[i] = place_exc
                                continue
                    pending.append(i)
        for i, session in placed.items():
            # A failed item's commit may not have been applied: only answered items' are recorded.
            it = items[i]
            if isinstance(outcomes[i], DraftMaskResult) and it.commit_tokens and it.commit_seq > session.last_seq:
                with session.lock:
                    session.committed.extend(int(t) for t in it.commit_tokens)
                    session.last_seq = it.commit_seq
        done = [a for a in outcomes if a is not None]
        assert len(done) == len(items), "every item is answered or failed, or the call raised"
        return done

    def _run_groups(
        self, groups: dict[str, list[int]], items: Sequence[DraftMaskItem], recs: dict[int, _SessionRecord]
    ) -> dict[str, Future[list[DraftMaskOutcome]]]:
        """One call per replica group, every one finished when this returns (so no call of
        the batch is still running against a client when the caller resends it)."""
        if len(groups) == 1:
            # One replica (the usual case): call it on this thread. A hop through the pool
            # adds a thread handoff to every round trip, on the step's critical path
            # whenever the worker has nothing to overlap the round trip with.
            ((address, idx),) = groups.items()
            fut: Future[list[DraftMaskOutcome]] = Future()
            try:
                fut.set_result(self._group_call(address, idx, items, recs))
            except Exception as exc:  # handed to the caller exactly as a pooled call's would be
                fut.set_exception(exc)
            return {address: fut}
        futs = {a: self._pool.submit(self._group_call, a, idx, items, recs) for a, idx in groups.items()}
        wait(futs.values())
        return futs

    def _group_call(
        self, address: str, idx: list[int], items: Sequence[DraftMaskItem], recs: dict[int, _SessionRecord]
    ) -> list[DraftMaskOutcome]:
        remote_items = [replace(items[i], session_id=recs[i].remote_id) for i in idx]
        try:
            outcomes = self._client(address).draft_mask_items(remote_items)
        except MaskServiceError as exc:
            # A failure of the call names no item; an id we did not send maps to None too.
            own = {r.session_id: items[i].session_id for i, r in zip(idx, remote_items)}
            exc.session_id = own.get(exc.session_id or "")
            raise
        for i, out in zip(idx, outcomes):
            if isinstance(out, MaskServiceError):
                # Position, not looks, maps the replica's id back (ids of both kinds are uuid hex).
                out.session_id = items[i].session_id
        return outcomes

    def close_session(self, session_id: str) -> None:
        with self._lock:
            rec = self._sessions.pop(session_id, None)
        if rec is None:
            return
        try:
            self._client(rec.address).close_session(rec.remote_id, owner=self.owner)
        except MaskServiceError as exc:
            logger.info(
                "close of session %s on %s failed (%s); the replica's TTL reclaims it",
                session_id,
                rec.address,
                exc.code.name,
            )

    def release_owner(self, owner: str | None = None) -> int:
        """Close, on every reachable replica, the sessions opened under ``owner`` (default:
        this router's), by any process; returns how many. Releasing this router's own
        owner forgets its sessions too. An unreachable replica is skipped: its sessions
        die with it or expire by TTL."""
        owner = self.owner if owner is None else owner
        if not owner:
            raise ValueError("release_owner needs an owner (or a router created with one)")
        if owner == self.owner:
            with self._lock:
                self._sessions.clear()
        closed = 0
        for address in self._replicas.addresses():
            try:
                closed += self._client(address).release_owner(owner)
            except MaskServiceError as exc:
                if exc.code not in _FAILOVER_CODES:
                    raise
                logger.warning("release of owner %s on %s skipped: %s", public_owner(owner), address, exc.code.name)
        return closed

    def session_count(self) -> int:
        """Sessions this router holds (replica-side counts may include other routers' sessions)."""
        return len(self._sessions)

    def close(self) -> None:
        self._replicas.close()
        with self._lock:
            clients = list(self._clients.values())
        for c in clients:
            c.close()
        self._pool.shutdown(wait=False)
