"""The worker's line to the mask service: a data thread and control threads in front of a MaskRouter.

* **Data** (one thread, ``mask-io``): every DraftMasks call. A mask request can be
  in flight while the main thread runs a forward (the target forward on the verify
  path, the draft forward during proposal; torch and gRPC both release the GIL while
  they wait), and the step waits on nothing but its own mask calls.
* **Control** (``mask-control`` threads): session opens and closes. They used to
  share the data thread, and under a flood of new requests (dozens of opens
  and closes a second, each slow against a busy service) a step's DraftMasks call
  queued behind them, on the step's critical path.
  A sequence's first DraftMasks is sent only once its open has answered (the step
  waits for ``session_opening``), so an open never races a data call.
* A close is handed to the control threads *through* the data thread: it runs after
  every DraftMasks call queued before it (the next step's prefetch may still name the
  session), so a close never races a call that names the session, which the router
  would answer NOT_FOUND by reopening the session (a leak). The hand-off costs the
  data thread microseconds, not a round trip.

The router is safe to use from these threads: its session table and replica state
are locked, and one session is only ever used by one thread at a time (opened on a
control thread, then used by the data thread, then closed on a control thread).

A batched request is a ``PendingMasks``: submitted at once, waited for only when
its rows are needed. The service answers each item on its own (the router's
``draft_mask_items``), so one sequence's failure fails that sequence alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from specmask.common import tracing
from specmask.common.grammar_spec import GrammarSpec
from specmask.gpu_worker.mask_errors import MaskFailure, describe_mask_failure
from specmask.mask_service.auth import public_owner
from specmask.mask_service.client.mask_client import MaskServiceError

if TYPE_CHECKING:
    from specmask.gpu_worker.sequence import SequenceState
    from specmask.mask_service.client.mask_client import DraftMaskItem, DraftMaskOutcome, DraftMaskResult
    from specmask.mask_service.client.service import MaskService

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Opens and closes in flight at once. Two, so one open that waits on a compile (a
# replica that evicted the grammar) does not hold every other open and close up.
CONTROL_THREADS = 2


@dataclass(frozen=True)
class OpenedSession:
    """A mask session the service opened for a sequence."""

    session_id: str
    # The tokens the session's grammar ends on (the service's stop set for the tokenizer, which
    # may hold more than the worker's EOS: SmolLM2's ``<|endoftext|>`` beside ``<|im_end|>``).
    # The service walks nothing past one, so the sequence must stop on every one of them.
    stop_token_ids: frozenset[int]


class MaskChannel:
    """One worker's access to the mask service: DraftMasks on the data thread, opens and closes
    on the control threads (see the module docstring)."""

    def __init__(self, router: MaskService, *, tokenizer_id: str, vocab_size: int) -> None:
        self._router = router  # a MaskRouter over replicas, or a MaskServiceClient of one
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mask-io")  # DraftMasks
        self._control = ThreadPoolExecutor(max_workers=CONTROL_THREADS, thread_name_prefix="mask-control")
        self.tokenizer_id = tokenizer_id
        self.vocab_size = vocab_size  # V: target logits width, so mask width W = ceil(V / 32)
        self.num_mask_words = (vocab_size + 31) // 32

    @classmethod
    def connect(
        cls,
        addresses: Sequence[str],
        *,
        tokenizer_id: str,
        vocab_size: int,
        deadline_s: float,
        owner: str = "",
        compile_wait_s: float | None = None,
    ) -> MaskChannel:
        """``owner``: a stable id of this worker; sessions carry it, and the channel first
        releases whatever an earlier process under that owner left open (a crash)."""
        from specmask.mask_service.client.router import DEFAULT_COMPILE_WAIT_S, MaskRouter

        wait_s = DEFAULT_COMPILE_WAIT_S if compile_wait_s is None else compile_wait_s
        router = MaskRouter(list(addresses), deadline_s=deadline_s, owner=owner, compile_wait_s=wait_s)
        if owner:
            try:
                released = router.release_owner()
            except Exception as exc:  # best effort: the service's TTL reclaims them anyway
                logger.warning("releasing mask sessions of %s failed: %s", public_owner(owner), exc)
            else:
                if released:
                    logger.warning(
                        "released %d mask sessions a previous process of %s left open", released, public_owner(owner)
                    )
        return cls(router, tokenizer_id=tokenizer_id, vocab_size=vocab_size)

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        # bind: the call's gRPC metadata carries the submitting iteration's span (tracing on).
        return self._pool.submit(tracing.bind(fn), *args)

    def open_session_async(self, spec: GrammarSpec, *, request_id: str = "") -> Future[OpenedSession]:
        """Open a session for the target tokenizer and logits width, on a control thread; the
        future gives the session (its id and the stop tokens its grammar ends on) or raises
        MaskServiceError. ``request_id`` travels to the service, which names it in its log
        lines about the session."""

        def call() -> OpenedSession:
            info = self._router.open_session_info(self.tokenizer_id, spec, self.vocab_size, request_id=request_id)
            return OpenedSession(info.session_id, frozenset(int(t) for t in info.stop_token_ids))

        return self._control.submit(tracing.bind(call))

    def draft_masks_async(self, items: Sequence[DraftMaskItem]) -> Future[tuple[list[DraftMaskOutcome], float]]:
        """Submit a batched DraftMasks call; the future gives (per item, in order, its rows or
        its own error; seconds on the I/O thread), and raises only if the call as a whole failed."""

        def call() -> tuple[list[DraftMaskOutcome], float]:
            t0 = time.perf_counter()
            outcomes = self._router.draft_mask_items(list(items))
            return outcomes, time.perf_counter() - t0

        return self._submit(call)

    def close_session_later(self, session_id: str, seq_id: str, *, request_id: str = "") -> None:
        """Fire-and-forget close, on a control thread once every DraftMasks call sent before it
        has finished (see the module docstring); a failure only leaks a session until the
        service's TTL. Raises RuntimeError once the channel is closed."""

        def call() -> None:
            try:
                self._router.close_session(session_id)
            except Exception as exc:
                logger.warning(
                    "[request_id=%s] seq %s: closing mask session %s failed: %s",
                    request_id or seq_id,
                    seq_id,
                    session_id,
                    exc,
                )

        self._submit(lambda: self._control.submit(call))

    def request(self, items: Sequence[DraftMaskItem], *, timeout_s: float) -> PendingMasks:
        """Submit one batched DraftMasks call now; wait for it with ``PendingMasks.wait``."""
        return PendingMasks(self, items, timeout_s=timeout_s)

    def close(self) -> None:
        """Drain pending closes, then release the router."""
        self._pool.shutdown(wait=True)  # first: it hands closes to the control threads
        self._control.shutdown(wait=True)
        close = getattr(self._router, "close", None)
        if close is not None:
            close()


def mask_item(
    seq: SequenceState,
    drafts: Sequence[int],
    *,
    last_row_only: bool,
    forced_up_to: int = 0,
    forced_rows: bool = False,
) -> DraftMaskItem:
    """``seq``'s request for the rows after ``drafts`` (M_0..M_k, or only M_k with
    ``last_row_only``) and, with ``forced_up_to``, the grammar-forced tokens where the
    service's walk over them stops (filling drafts up to that many; with ``forced_rows``
    also the row after each of them), carrying its pending commit. Every request of a step
    carries the same (commit_tokens, commit_seq): whichever reaches the service first
    applies it, the rest are no-ops, so there is never a separate commit call."""
    from specmask.mask_service.client.mask_client import DraftMaskItem

    assert seq.session_id is not None, f"seq {seq.seq_id} has no mask session"
    commit_tokens, commit_seq = seq.next_commit()
    return DraftMaskItem(
        session_id=seq.session_id,
        draft_tokens=list(drafts),
        commit_tokens=commit_tokens,
        commit_seq=commit_seq,
        last_row_only=last_row_only,
        forced_up_to=forced_up_to,
        forced_rows=forced_rows,
        # Greedy output is the target's argmax chain whatever the drafts: pooled spellings
        # are safe. A sampled request keeps to its own votes, so a seeded one replays.
        shared_spellings=forced_rows and seq.request.sampling.temperature == 0.0,
    )


@dataclass
class MaskReply:
    """What one batched request gave, keyed by mask session id (unique per sequence)."""

    results: dict[str, DraftMaskResult] = field(default_factory=dict)  # session_id -> its rows
    errors: dict[str, MaskFailure] = field(default_factory=dict)  # session_id -> why; only that sequence fails
    wait_s: float = 0.0  # time the caller was blocked in wait()


class PendingMasks:
    """One batched DraftMasks call in flight on the channel's I/O thread."""

    def __init__(self, channel: MaskChannel, items: Sequence[DraftMaskItem], *, timeout_s: float) -> None:
        self._items = {item.session_id: item for item in items}
        self._timeout_s = timeout_s
        self._future = channel.draft_masks_async(list(self._items.values()))
        self._reply: MaskReply | None = None

    @property
    def session_ids(self) -> frozenset[str]:
        """The sessions this request covers."""
        return frozenset(self._items)

    def settle(self) -> None:
        """Block until the call has finished (or timed out) without taking its reply."""
        futures_wait([self._future], timeout=self._timeout_s)

    def wait(self) -> MaskReply:
        """Block until the answer is in: each item's rows, or its own error, which fails only
        that sequence (the service answers the others all the same, their commits applied).
        A failure of the call as a whole (replicas unreachable, timeout, batch-level refusal)
        fails every item. Waiting again returns the same reply.
        """
        if self._reply is not None:
            return self._reply
        t0 = time.perf_counter()
        reply = MaskReply()
        try:
            outcomes, _ = self._future.result(timeout=self._timeout_s)
            if len(outcomes) != len(self._items):
                raise RuntimeError(f"mask service returned {len(outcomes)} answers for {len(self._items)} items")
        except FutureTimeout:
            late = MaskFailure.tier_unavailable(f"no mask answer within {self._timeout_s:.1f}s")
            reply.errors.update((session_id, late) for session_id in self._items)
        except Exception as exc:
            why = describe_mask_failure(exc, "computing masks")
            reply.errors.update((session_id, why) for session_id in self._items)
        else:
            for session_id, outcome in zip(self._items, outcomes):
                if isinstance(outcome, MaskServiceError):
                    logger.warning("mask call failed for session %s: %s", session_id, outcome)
                    reply.errors[session_id] = describe_mask_failure(outcome, "computing masks")
                else:
                    reply.results[session_id] = outcome
        reply.wait_s = time.perf_counter() - t0
        self._reply = reply
        return reply
