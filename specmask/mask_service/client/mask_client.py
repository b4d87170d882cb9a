"""Client library for the mask service (used by the GPU worker and the orchestrator).

* Deadlines on every call; retries with backoff on UNAVAILABLE and
  DEADLINE_EXCEEDED for calls that are safe to repeat: DraftMasks and Commit
  are (commits are idempotent by sequence number, masks never change
  committed state); OpenSession is retried only on UNAVAILABLE (a lost reply
  could leak a session, which the idle TTL reclaims).
* Decodes the compact row format (mask_service.wire) into a packed int32 row
  table with numpy (mask_service.row_table); results name rows as slots of that
  table, never as dense copies; torch is imported lazily, only to wrap results,
  so importing this module never pulls torch in.
* DraftMasks answers per item (``draft_mask_items``: each item's rows, or the error
  the service gave that item alone); ``draft_masks`` is the all-or-nothing form.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np

from specmask.common import tracing
from specmask.common.grammar_spec import GrammarSpec
from specmask.mask_service.auth import CLIENT_METADATA_KEY, client_metadata, token_from_env
from specmask.mask_service.client.row_table import MaskRows, RowTable, TableView
from specmask.mask_service.convert import grammar_to_proto
from specmask.mask_service.wire import MissingRow
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2_grpc as pb_grpc
from specmask.proto.rpc_status import details_of

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Rows kept per vocab width on the client: 2048 Llama-3 rows = 32 MiB. Real
# schemas reuse few distinct rows (82% of rows repeat), so this rarely fills.
DEFAULT_TABLE_CAPACITY = 2048
_BACKOFF_S = 0.05
# The deadline of the calls that may wait on a compile (ValidateGrammar, OpenSession).
# The replica answers such a call when its grammar is ready, or just before the
# caller's deadline; a short deadline would turn a compile that will finish (slowly,
# on a busy box) into "still compiling, retry". A grammar over its CPU budget is
# refused by the replica long before this.
DEFAULT_COMPILE_WAIT_S = 120.0
MAX_MESSAGE_BYTES = 64 * 1024**2
# gRPC's default reconnect backoff grows to 120 s, and a channel in backoff
# fails every call at once with UNAVAILABLE: a replica that restarts would stay
# unreachable long after it is back, defeating the router's 5 s cool-down.
# Capped at 2 s, a restarted replica is used again within a cool-down or two.
RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
# Resyncs per call before giving up: one is enough unless the table is
# thrashing (a batch needs more distinct rows than the table holds).
_MAX_RESYNCS = 2


class MaskServiceError(Exception):
    """A mask-service failure with its gRPC status code (and the session it concerns, if one)."""

    def __init__(self, code: grpc.StatusCode, message: str, session_id: str | None = None, *, reason: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.session_id = session_id
        self.reason = reason  # ErrorInfo reason from the server, e.g. GRAMMAR_TOO_COMPLEX ("" if none)


@dataclass(frozen=True)
class DraftMaskItem:
    session_id: str
    draft_tokens: Sequence[int]  # d_1..d_k (k may be 0)
    commit_tokens: Sequence[int] = ()  # committed FIRST (idempotent by commit_seq)
    commit_seq: int = 0  # >= 1 when commit_tokens is non-empty; a seen seq is a no-op
    last_row_only: bool = False  # return only M_k (the row after d_1..d_k): draft-side masking
    # Ask for the forced continuation where the walk stops (after d_k, or before the first
    # refused draft), filling drafts up to this many in all (0 = none).
    forced_up_to: int = 0
    # With a forced continuation asked for: also the row after each forced token
    # (DraftMaskResult.forced_rows), so the state after the run needs no request of its own.
    forced_rows: bool = False
    # Spell forced text by the votes of every session of the tokenizer, not this session's
    # alone (grammar/spellings.py): for greedy requests, whose output no draft can change.
    shared_spellings: bool = False


@dataclass(frozen=True)
class DraftMaskResult:
    # [k+1] rows ([1] with last_row_only) as slots of the client's interned table (no copy);
    # rows past the stop are all-ones (slot 0). Per row: allowed count, single token, bits.
    rows: MaskRows
    num_grammar_accepted: int  # how many of d_1..d_k the grammar accepts (prefix length)
    terminated: bool  # matcher terminated after commit_tokens (committed state)
    # The grammar's forced continuation where the walk stopped (forced_up_to); never after a
    # terminated state:
    # canonical tokens, each grammar-accepted, stopped short of an ambiguous boundary; never committed.
    forced_tokens: tuple[int, ...] = ()
    # A forced continuation was asked for: forced_tokens (maybe empty) follow the accepted drafts.
    forced_at_stop: bool = False
    # With DraftMaskItem.forced_rows: row j = the mask after forced_tokens[:j + 1] (all-ones
    # where the grammar ended), one per forced token; None when the reply has none (not
    # asked, or nothing forced).
    forced_rows: MaskRows | None = None

    @property
    def bitmask(self) -> torch.Tensor:  # [k+1, W] int32: a dense copy of ``rows`` (tests, tools)
        import torch

        return torch.from_numpy(self.rows.dense())


# One item's answer in a DraftMasks call: its rows, or why the service refused that item
# (the error names the item's session; the call's other items are answered all the same).
DraftMaskOutcome = DraftMaskResult | MaskServiceError


def all_or_raise(outcomes: Sequence[DraftMaskOutcome]) -> list[DraftMaskResult]:
    """Every item's result, or the first failed item's error raised (naming its session)."""
    results: list[DraftMaskResult] = []
    for out in outcomes:
        if isinstance(out, MaskServiceError):
            raise out
        results.append(out)
    return results


class MaskServiceClient:
    def __init__(
        self,
        address: str,
        *,
        deadline_s: float = 5.0,
        max_retries: int = 3,
        table_capacity: int = DEFAULT_TABLE_CAPACITY,
        track_bytes: bool = False,
        auth_token: str | None = None,
        own_connection: bool = False,
        compile_wait_s: float = DEFAULT_COMPILE_WAIT_S,
    ) -> None:
        """``compile_wait_s``: the deadline of ValidateGrammar and OpenSession, which wait for the
        grammar's compile (at least ``deadline_s``).

        ``auth_token``: the replicas' shared token (None = $SPECMASK_MASK_TOKEN, "" = none).

        ``own_connection``: a connection of this client's own, not the one gRPC shares between
        channels to the same address in a process. A shared connection that failed is in
        reconnect backoff (up to RECONNECT_OPTIONS' 2 s), and every call on it fails at once
        with its last error, longer than this client's retries wait: a replica that has just
        come back would look down. Probes and tools that must see the replica as it is now
        (a test's session count after a restart) want their own.
        """
        self.address = address
        self._metadata = client_metadata(token_from_env() if auth_token is None else auth_token)
        # Serialized size of the last DraftMasks response (benchmarks); off by default, it costs a pass.
        self.track_bytes = track_bytes
        self.last_response_bytes = 0
        self._deadline = deadline_s
        self._compile_wait = max(deadline_s, compile_wait_s)
        self._retries = max_retries
        self._capacity = table_capacity
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                *RECONNECT_OPTIONS,
                *([("grpc.use_local_subchannel_pool", 1)] if own_connection else []),
            ],
        )
        self._stub = pb_grpc.MaskServiceStub(self._channel)
        self.client_id = uuid.uuid4().hex
        self._generation = 1
        self._tables: dict[int, RowTable] = {}
        self._lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------
    def _call(
        self,
        fn: Callable[..., T],
        request: Any,
        *,
        retry_on: tuple[grpc.StatusCode, ...] = _RETRYABLE,
        metadata: tuple[tuple[str, str], ...] = (),
        timeout_s: float | None = None,
    ) -> T:
        attempt = 0
        while True:
            try:
                # The caller's trace context, for the replica's span to continue (() while tracing is off).
                call_metadata = self._metadata + metadata + tracing.grpc_metadata()
                return fn(request, timeout=timeout_s or self._deadline, metadata=call_metadata)
            except grpc.RpcError as exc:
                code = exc.code()
                if code in retry_on and attempt < self._retries:
                    attempt += 1
                    time.sleep(_BACKOFF_S * 2 ** (attempt - 1))
                    continue
                reason = details_of(exc).reason
                raise MaskServiceError(code, exc.details() or "", reason=reason) from None

    @staticmethod
    def _target(tokenizer_id: str, spec: GrammarSpec, vocab_size: int | None) -> pb.GrammarTarget:
        return pb.GrammarTarget(tokenizer_id=tokenizer_id, grammar=grammar_to_proto(spec), vocab_size=vocab_size or 0)

    @property
    def dict_generation(self) -> int:
        return self._generation

    # -- API ----------------------------------------------------------------
    def validate_grammar(
        self, tokenizer_id: str, spec: GrammarSpec, vocab_size: int | None = None, *, client: str = ""
    ) -> pb.ValidateGrammarResponse:
        """Compile (or find) the grammar; the response names its engine and enforcement ("exact"/"checked").
        ``client``: the end client it is compiled for (the replica's compile queue is fair by it)."""
        return self._call(
            self._stub.ValidateGrammar,
            pb.ValidateGrammarRequest(target=self._target(tokenizer_id, spec, vocab_size)),
            metadata=((CLIENT_METADATA_KEY, client),) if client else (),
            retry_on=(grpc.StatusCode.UNAVAILABLE,),
            timeout_s=self._compile_wait,
        )

    def open_session(
        self,
        tokenizer_id: str,
        spec: GrammarSpec,
        vocab_size: int | None = None,
        *,
        owner: str = "",
        request_id: str = "",
    ) -> str:
        """A new session; ``owner`` (optional) lets ``release_owner`` close it with its siblings;
        ``request_id`` (optional) is named in the service's log lines about the session."""
        return self.open_session_info(tokenizer_id, spec, vocab_size, owner=owner, request_id=request_id).session_id

    def open_session_info(
        self,
        tokenizer_id: str,
        spec: GrammarSpec,
        vocab_size: int | None = None,
        *,
        owner: str = "",
        request_id: str = "",
    ) -> pb.OpenSessionResponse:
        """Like open_session, with vocab_size / num_mask_words / stop_token_ids of the session."""
        req = pb.OpenSessionRequest(
            target=self._target(tokenizer_id, spec, vocab_size), owner=owner, request_id=request_id
        )
        return self._call(
            self._stub.OpenSession, req, retry_on=(grpc.StatusCode.UNAVAILABLE,), timeout_s=self._compile_wait
        )

    def release_owner(self, owner: str) -> int:
        """Close every session opened with ``owner`` on this replica; returns how many. Safe to retry."""
        return self._call(self._stub.ReleaseOwner, pb.ReleaseOwnerRequest(owner=owner)).closed

    def commit(self, session_id: str, seq: int, tokens: Sequence[int]) -> bool:
        """Commit emitted tokens; returns whether the matcher terminated. Safe to retry."""
        try:
            resp = self._call(self._stub.Commit, pb.CommitRequest(session_id=session_id, seq=seq, tokens=list(tokens)))
        except MaskServiceError as exc:
            exc.session_id = session_id
            raise
        return resp.terminated

    def close_session(self, session_id: str, owner: str = "") -> None:
        """Close a session; ``owner``: the one it was opened with (the service refuses another)."""
        self._call(self._stub.CloseSession, pb.CloseSessionRequest(session_id=session_id, owner=owner))

    def session_count(self) -> int:
        return self._call(self._stub.SessionCount, pb.SessionCountRequest()).count

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> MaskServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- draft masks ----------------------------------------------------------
    def _draft_masks_raw(
        self, items: Sequence[DraftMaskItem]
    ) -> tuple[pb.DraftMasksResponse, TableView | None, np.ndarray]:
        """One DraftMasks round trip plus decoding.

        Returns (response, a view of the table, slots [num_rows] int32 into it). The
        view is taken under the client lock; its rows never change afterwards, even
        if another thread's call clears and refills the table right after.
        """
        proto_items = [
            pb.DraftMaskItem(
                session_id=it.session_id,
                draft_tokens=list(it.draft_tokens),
                commit_tokens=list(it.commit_tokens),
                commit_seq=it.commit_seq,
                last_row_only=it.last_row_only,
                forced_up_to=it.forced_up_to,
                forced_rows=it.forced_rows,
                shared_spellings=it.shared_spellings,
            )
            for it in items
        ]
        for _ in range(_MAX_RESYNCS + 1):
            req = pb.DraftMasksRequest(items=proto_items, client_id=self.client_id, dict_generation=self._generation)
            resp = self._call(self._stub.DraftMasks, req)
            if self.track_bytes:
                self.last_response_bytes = resp.ByteSize()
            if len(resp.results) != len(items):
                # Answers are matched to items by position: a short or long reply matches none.
                why = f"mask service returned {len(resp.results)} results for {len(items)} items"
                raise MaskServiceError(grpc.StatusCode.INTERNAL, why)
            if not resp.num_mask_words:
                return resp, None, np.zeros(0, dtype=np.int32)
            with self._lock:
                table = self._tables.get(resp.num_mask_words)
                if table is None:
                    table = self._tables[resp.num_mask_words] = RowTable(resp.num_mask_words, self._capacity)
                try:
                    slots = table.absorb(resp.new_rows, resp.row_ids)
                    return resp, table.view(), slots
                except MissingRow as exc:
                    # Our dictionary and the server's belief diverged (lost reply,
                    # out-of-order replies, server restart, full table): resync.
                    logger.info(
                        "row dictionary resync (%s), generation %d -> %d", exc, self._generation, self._generation + 1
                    )
                    if not table.has_room(len(resp.new_rows)) or not table.has_room(len(resp.row_ids)):
                        table.clear()
                    self._generation += 1
        raise MaskServiceError(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "row dictionary could not be synchronised; raise table_capacity"
        )

    def draft_masks(self, items: Sequence[DraftMaskItem]) -> list[DraftMaskResult]:
        """Every item's rows; a failed item raises its error (``MaskServiceError.session_id``
        names it), and the others' answers are dropped: ``draft_mask_items`` keeps them."""
        return all_or_raise(self.draft_mask_items(items))

    def draft_mask_items(self, items: Sequence[DraftMaskItem]) -> list[DraftMaskOutcome]:
        """One DraftMasks call; per item, in order, its rows or the error the service gave that
        item alone (its session unknown, a token it refused, ...). A failure of the call itself
        (unreachable, deadline, a reply that cannot be decoded) raises MaskServiceError with no
        session. A failed item's commit may or may not be applied; the others' are."""
        resp, view, slots = self._draft_masks_raw(items)
        out: list[DraftMaskOutcome] = []
        offset = 0
        for it, r in zip(items, resp.results):
            if r.error_code:
                offset += r.num_rows + r.num_forced_rows  # none, as the server answers; skipped all the same
                code = _STATUS_BY_NUMBER.get(r.error_code, grpc.StatusCode.UNKNOWN)
                out.append(MaskServiceError(code, r.error_message, it.session_id))
                continue
            assert view is not None  # a result implies a row width
            rows = MaskRows(view, slots[offset : offset + r.num_rows])
            offset += r.num_rows
            forced_rows = None
            if r.num_forced_rows:
                forced_rows = MaskRows(view, slots[offset : offset + r.num_forced_rows])
                offset += r.num_forced_rows
            out.append(
                DraftMaskResult(
                    rows,
                    r.num_grammar_accepted,
                    r.terminated,
                    forced_tokens=tuple(r.forced_tokens),
                    forced_at_stop=r.forced_at_stop,
                    forced_rows=forced_rows,
                )
            )
        return out


# A DraftMasks item's ``error_code`` is its status's number (mask_service.errors).
_STATUS_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}
