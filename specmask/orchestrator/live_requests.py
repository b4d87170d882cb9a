"""The engine's live requests: where each one is, and every way one ends or goes back in line.

A request is live from admission until it finishes: its id is reserved while it validates
(counted against its client), then it waits in the queue, then ``placement.Placer`` puts it
on a worker (``slot_of``: in that slot's ``to_add``, then ``running``). It leaves here,
whatever ends it: its worker or the end check finished it, it was cancelled (or a drain
ended it), its worker's batch failed, or its worker was lost after it had streamed tokens.
A request a lost worker held before producing anything, and a checked-mode resample, go back
to the head of the queue instead. Each of these frees or adds work, so each asks the engine
to place again: a freed batch slot is refilled at once. See docs/design.md, "Who runs what".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence

from specmask.gpu_worker.types import ErrorKind, FinishReason
from specmask.orchestrator.checked_retry import fresh_seed
from specmask.orchestrator.engine_config import EngineConfig
from specmask.orchestrator.errors import DuplicateRequestId, Overloaded
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.placement import Placer
from specmask.orchestrator.request import Request
from specmask.orchestrator.types import GenerationRequest
from specmask.orchestrator.worker_slot import WorkerSlot

logger = logging.getLogger(__name__)


class LiveRequests:
    """The live requests, the queue and where each placed one is, shared with the ``Placer``
    (``placer``) that moves waiting ones onto the workers. Runs on the engine's loop.

    ``config()``: the engine's settings now (read on each use, so a changed config applies at
    once). ``place()``: the engine's placement pass, called after every change here."""

    def __init__(
        self,
        slots: Sequence[WorkerSlot],
        metrics: OrchestratorMetrics,
        config: Callable[[], EngineConfig],
        place: Callable[[], None],
    ) -> None:
        self.live: dict[str, Request | None] = {}  # None: id reserved while validating
        self.waiting: collections.deque[Request] = collections.deque()
        self.slot_of: dict[str, WorkerSlot] = {}
        self.placer = Placer(self.waiting, slots, self.slot_of, self.live)
        self._metrics = metrics
        self._config = config
        self._place = place

    def __len__(self) -> int:
        """Requests admitted or validating and not finished."""
        return len(self.live)

    def unfinished(self) -> list[Request]:
        """The admitted requests not finished yet (not the ones still validating)."""
        return [r for r in self.live.values() if r is not None and not r.finished]

    def queued_prompt_tokens(self) -> int:
        return sum(len(r.seq.prompt_token_ids) for r in self.waiting)

    # ---- admission ---------------------------------------------------------

    def reserve(self, req: GenerationRequest) -> None:
        """Take ``req``'s id while it validates, counted against its client. Raises
        ``DuplicateRequestId`` when the id is live, ``Overloaded`` past the per-client cap."""
        if req.request_id in self.live:
            raise DuplicateRequestId(f"request_id {req.request_id!r} is already in flight")
        cap = self._config().max_inflight_per_client
        if cap and req.client and self.placer.clients.in_flight(req.client) >= cap:
            raise Overloaded(f"this client already has {cap} requests in flight (the per-client limit); retry later")
        self.live[req.request_id] = None
        self.placer.clients.admit(req.request_id, req.client)

    def unreserve(self, request_id: str) -> None:
        """A reserved request was refused before it was queued: its id and its client's count are free."""
        del self.live[request_id]
        self._release_client(request_id)

    def enqueue(self, request: Request) -> None:
        """A reserved request passed validation: it waits at the back of the queue (not placed yet)."""
        self.live[request.request_id] = request
        self.waiting.append(request)

    # ---- endings -----------------------------------------------------------

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED, error: str | None = None) -> None:
        """Finish a live request now (CANCELLED, or ``reason``); its worker state is freed on that
        worker's next iteration. A no-op for unknown or finished requests."""
        request = self.live.get(request_id)
        if request is None or request.finished:
            return
        slot = self.slot_of.get(request_id)
        if slot is None:
            self.waiting.remove(request)
        elif request in slot.to_add:
            slot.to_add.remove(request)  # placed, but its add() was never sent: nothing to remove
        else:
            slot.running.pop(request_id, None)
            slot.to_remove.append(request_id)
            slot.wake.set()
        request.log.info("cancelled" if error is None else f"ended: {error}")
        self.finish(request, reason, error)

    def finish(
        self, request: Request, reason: FinishReason, error: str | None = None, kind: ErrorKind | None = None
    ) -> None:
        """End ``request`` (its final event goes to the client) and forget it. The caller has
        taken it out of its slot's ``running`` or the queue."""
        request.finish(reason, error, kind)
        if request.grammar is not None:
            self._metrics.grammar_requests.labels(enforcement=request.grammar.enforcement).inc()
        self.live.pop(request.request_id, None)
        self._release_client(request.request_id)
        self.slot_of.pop(request.request_id, None)
        assert request.finish_time is not None  # set by Request.finish
        self._metrics.observe_finish(
            reason, request.usage, request.arrival_time, request.first_token_time, request.finish_time
        )
        self._place()

    def fail_batch(self, slot: WorkerSlot, message: str) -> None:
        """A worker call failed with the worker alive: end its batch with ERROR, and free it there."""
        logger.error("worker %d: %s", slot.index, message)
        failed = list(slot.running.values())
        slot.running.clear()
        slot.to_remove.extend(r.request_id for r in failed)
        for request in failed:
            self.finish(request, FinishReason.ERROR, message)

    def fail_waiting(self, message: str) -> None:
        """End every queued request with ERROR and ``message``."""
        for request in list(self.waiting):
            self.waiting.remove(request)
            self.finish(request, FinishReason.ERROR, message)

    # ---- back in line --------------------------------------------------------

    def resample(self, request: Request, reason: str) -> None:
        """Checked mode: discard the held attempt and queue the request again with a fresh seed."""
        request.log.info("checked mode: attempt %d failed the end check (%s); resampling", request.attempts, reason)
        request.restart(dataclasses.replace(request.seq, sampling=fresh_seed(request.seq.sampling, request.attempts)))
        self.slot_of.pop(request.request_id, None)  # the worker freed it when it reported completion
        self.waiting.appendleft(request)  # it was admitted already: first in line
        self._place()

    def worker_lost(self, slot: WorkerSlot, what: str) -> None:
        """``slot`` was taken out of placement (``what`` happened to it): requeue or fail what it held."""
        held = list(slot.running.values())
        slot.running.clear()
        slot.to_remove.clear()
        # Requests that have generated nothing yet (prefilling, or never stepped) lose nothing
        # by starting over: with the ones placed here while its last call ran, never sent, they
        # go back to the head of the line, in order, for another worker (or are failed with the
        # rest if none is left). A request that has produced tokens cannot be replayed
        # without sending them twice (or, sampled, differently): it ends with an error.
        unstarted = [r for r in held if not r.token_ids]
        lost = [r for r in held if r.token_ids]
        for request in reversed([*unstarted, *slot.to_add]):
            self.slot_of.pop(request.request_id, None)
            self.waiting.appendleft(request)
        slot.to_add.clear()
        if unstarted:
            logger.warning("worker %d: %d requests that had not started are queued again", slot.index, len(unstarted))
            self._metrics.requeued.inc(len(unstarted))
        for request in lost:
            self.finish(request, FinishReason.ERROR, f"GPU worker {slot.index} {what}; the request was cut off")
        self._place()

    def _release_client(self, request_id: str) -> None:
        linger = self._config().fair_share_linger_s
        if self.placer.clients.release(request_id) and linger > 0:
            # When its linger ends, the share it kept may go to the others.
            with contextlib.suppress(RuntimeError):  # no loop: nothing waits to be placed
                asyncio.get_running_loop().call_later(linger, self._place)
