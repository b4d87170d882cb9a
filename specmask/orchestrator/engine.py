"""Admission, placement and the step loop: continuous batching over GPU workers.

Life of a request:

1. ``submit`` checks the admission bound (RESOURCE_EXHAUSTED past it),
   validates on a thread pool (tokenize, sampling checks, ValidateGrammar on
   the mask service) and queues the request as *waiting*.
2. ``_place`` moves waiting requests onto the least-loaded healthy worker with
   a free batch slot; they go with that worker's next iteration (an idle
   worker's loop is woken at once).
3. Each worker has its own step loop (an asyncio task), so a slow worker never
   stalls the others. One iteration is one Ray call, ``iterate``: ``remove``
   (cancelled or stop-string-finished sequences), ``add`` (what was placed
   since the last call; the worker starts opening their mask sessions), then
   ``step`` (one decoding step for every active sequence: propose, masks in
   flight with the target forward, verify, commit — see docs/INTERFACES.md).
   Every await has a timeout.
4. Step outputs go to each ``Request`` (detokenize, stop strings, stream);
   requests the worker finished are freed by the worker, requests finished here
   (stop string, cancel) are ``remove``d in the next iteration. Freed slots are
   refilled from the waiting queue at once: requests join and leave the batch
   every step.

A sequence-level error from the worker finishes only that request (ERROR). A
failed ``step`` call finishes that worker's batch with ERROR; a dead or
unresponsive worker is taken out of placement: its requests that had streamed
tokens finish with ERROR, the others go back to the head of the queue, and the
server keeps serving while any worker is healthy. ``_recover`` then probes it:
once it answers again (Ray restarted the crashed actor, or a stuck call
returned) it is reset, checked to serve the same model, and put back; an actor
that is dead for good, or has not answered for a liveness limit, is killed and
replaced by a new one (bounded, with backoff). While no worker is healthy and
one is being recovered, queued and new requests wait for it, up to
``EngineConfig.recovery_wait_s``. Meanwhile the mask sessions it held are
released by owner on every replica, so a worker that never comes back leaks none.

Never lie: a grammar request the worker reports GRAMMAR_COMPLETE is
finished only after ``output_check`` accepts its final text against the caller's
grammar (on the executor, off the loop); otherwise, or if the check itself fails,
it finishes with GRAMMAR_VIOLATION and a typed error, counted in
``specmask_grammar_violations`` and logged with the grammar's hash. A violation
the worker caught on device arrives as GRAMMAR_VIOLATION already. A grammar request
a stop string ended (STOP) goes through the same check: a stop match counts only where
the grammar may end (stop_strings.py), and the final text is checked again before STOP
is reported, exactly as for GRAMMAR_COMPLETE.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import ActorDiedError, RayTaskError

from specmask.gpu_worker.config import CPU_ITERATION_TOKENS, GPU_ITERATION_TOKENS
from specmask.gpu_worker.kv_budget import KVBudget
from specmask.gpu_worker.types import (
    LIVENESS_GROUP,
    FinishReason,
    Iteration,
    SamplingParams,
    StepOutput,
    UnknownSequenceError,
    WorkerInfo,
    WorkerProgress,
)
from specmask.orchestrator.detokenizer import Decoder
from specmask.orchestrator.errors import DuplicateRequestId, Overloaded, ShuttingDown, Unavailable
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.output_check import OutputChecker, OutputCheckError, Verdict
from specmask.orchestrator.placement import BatchLoad, client_share, next_to_place, step_rows
from specmask.orchestrator.request import Request
from specmask.orchestrator.token_admission import PromptTokenBounds
from specmask.orchestrator.types import GenerationRequest
from specmask.orchestrator.validation import RequestValidator, ValidatedRequest

logger = logging.getLogger(__name__)
# How often drain() looks whether the live requests have finished.
_DRAIN_POLL_S = 0.05
# End-of-request output checks (short CPU work) have threads of their own: on the
# validation pool they queued behind validations blocked for seconds on a grammar
# compile, so a flood of new schemas delayed every request's completion.
_OUTPUT_CHECK_THREADS = 2

# On shutdown, remove() frees what the workers still hold: fast (KV caches,
# session closes), though it may queue behind one in-flight step. Bounded so a
# stuck worker cannot hold shutdown up; the workers are killed right after.
_REMOVE_ON_SHUTDOWN_TIMEOUT_S = 10.0
# A lost worker is probed (info(), then reset()) at this interval, doubling up
# to the cap while it does not answer: Ray restarts a crashed actor in seconds
# (plus model loading); a hung one answers once its stuck call returns.
_RECOVERY_PROBE_S = 1.0
_RECOVERY_PROBE_MAX_S = 10.0
# Replacement actors started for one loss before the worker is given up, waiting this long
# after the first failed start, doubling up to the cap (a failed start is usually a lack of
# resources, e.g. the dead process's GPU memory not yet freed, which time cures).
_REPLACE_ATTEMPTS = 5
_REPLACE_BACKOFF_S = 2.0
_REPLACE_BACKOFF_MAX_S = 30.0
# Checked mode: attempt n of a seeded request uses seed + n * this (odd, so attempts never share a seed).
_SEED_STRIDE = 0x9E3779B97F4A7C15
# A worker whose heartbeat answers but whose progress count has not moved for this many
# liveness limits is hung (e.g. a deadlocked iteration), not slow: it is taken out.
_STALL_LIMITS = 10


@dataclass(frozen=True)
class EngineConfig:
    max_queue: int  # requests validating or waiting beyond which submit() refuses
    # The liveness limit: an iterate() call running past it is not a failure while the worker's
    # heartbeat (GpuWorker.progress) answers within it and its progress count moves; the bound
    # of every other Ray call to a worker.
    step_timeout_s: float
    validation_threads: int
    # Requests one end client (GenerationRequest.client) may have in flight; 0 = no cap. Bounds
    # one client's share of the batches, so its flood is its own queueing.
    max_inflight_per_client: int = 0
    # Place the oldest request of the client holding the fewest batch slots, and none past a
    # client's share of the batch while others have work (orchestrator.placement);
    # False: strict arrival order (bench.fairness's control).
    fair_placement: bool = True
    # A client counts as having work for this long after its last request ended, so one sending
    # requests back to back keeps its share between them (orchestrator.placement). 0 = not at all.
    fair_share_linger_s: float = 2.0
    # The workers' iteration budget (WorkerConfig.max_iteration_tokens; 0 = by device): the rows
    # of a step that fair placement shares between clients.
    max_iteration_tokens: int = 0
    # Queue and per-worker batch bounded in prompt tokens (orchestrator.token_admission).
    prompt_token_bounds: PromptTokenBounds = field(default_factory=PromptTokenBounds)
    # With no healthy worker left while a lost one is being recovered or replaced: how long the
    # queued requests, and new ones, wait for it (from the loss of the last one) before they
    # fail (queued: ERROR) or are refused (new: UNAVAILABLE, a retry hint). 0 = fail at once.
    recovery_wait_s: float = 120.0
    # Replacement actors the engine may start per worker over its life (-1 = no limit, 0 = none:
    # a lost worker comes back only if it answers again).
    max_restarts: int = -1


@dataclass(eq=False)
class WorkerSlot:
    """Engine-side state of one GPU worker actor."""

    index: int
    actor: Any  # ray.actor.ActorHandle of gpu_worker.actor.GpuWorker
    info: WorkerInfo
    capacity: int  # max active sequences (WorkerConfig.max_batch)
    running: dict[str, Request] = field(default_factory=dict)  # sent to the worker (add in flight or done)
    # Placed here, not sent yet: they go with the loop's next iterate() call (Engine._iterate).
    to_add: list[Request] = field(default_factory=list)
    to_remove: list[str] = field(default_factory=list)  # finished here; the worker still holds them
    healthy: bool = True
    gone: bool = False  # lost for good: dead with no replacement allowed, or replacements failed
    restarts: int = 0  # replacement actors started for it (Engine._recover)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Task | None = None  # closing a lost worker's mask sessions

    @property
    def load(self) -> int:
        return len(self.running) + len(self.to_add)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the requests placed here and not finished (the token bound's batch)."""
        return sum(len(r.seq.prompt_token_ids) for r in (*self.running.values(), *self.to_add))

    def has_work(self) -> bool:
        return bool(self.running or self.to_remove or self.to_add)


class Engine:
    """Owns live requests and the per-worker step loops. Runs on one asyncio loop."""

    def __init__(
        self,
        slots: Sequence[WorkerSlot],
        validator: RequestValidator,
        tokenizer: Decoder,
        config: EngineConfig,
        metrics: OrchestratorMetrics,
        *,
        release_sessions: Callable[[str], int] | None = None,
        output_checker: OutputChecker | None = None,
        replace_worker: Callable[[Any], Awaitable[tuple[Any, WorkerInfo]]] | None = None,
    ) -> None:
        """``release_sessions(owner)``: closes every mask session a lost worker left open
        (blocking; returns how many); None leaves them to the mask service's idle TTL.
        ``output_checker``: the end-of-request grammar check (always on; None = a new one).
        ``replace_worker(actor)``: kills a lost worker's actor and starts a new one, returning
        its handle and info once it has loaded (worker_pool.replace_worker); None = a lost
        worker is only probed until it answers again."""
        if not slots:
            raise ValueError("the engine needs at least one worker")
        self._slots = list(slots)
        self._validator = validator
        self._tokenizer = tokenizer
        self._config = config
        self._metrics = metrics
        self._release_sessions = release_sessions
        self._replace_worker = replace_worker
        # Set while a worker is healthy, or when none is and none is being recovered any more:
        # requests waiting in submit() for a replacement wait on it.
        self._worker_up = asyncio.Event()
        self._worker_up.set()
        # While no worker is healthy and one is being recovered: when the waiting ends (monotonic).
        self._down_deadline: float | None = None
        self.output_checker = output_checker if output_checker is not None else OutputChecker()
        self._checking: set[asyncio.Task] = set()  # end-of-request checks in flight
        self._on_health_change: Callable[[bool], None] | None = None
        self._draining = False
        self._executor = ThreadPoolExecutor(config.validation_threads, thread_name_prefix="validate")
        self._check_executor = ThreadPoolExecutor(_OUTPUT_CHECK_THREADS, thread_name_prefix="output-check")
        self._live: dict[str, Request | None] = {}  # None: id reserved while validating
        self._waiting: collections.deque[Request] = collections.deque()
        self._slot_of: dict[str, WorkerSlot] = {}
        self._client_of: dict[str, str] = {}  # request id -> end client, while in _live
        self._per_client: collections.Counter[str] = collections.Counter()
        self._client_idle_since: dict[str, float] = {}  # client -> when its last live request ended
        self._validating = 0
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._metrics.healthy_workers.set(len(self._slots))
        self._publish_load()

    # ---- lifecycle -------------------------------------------------------

    def set_health_listener(self, listener: Callable[[bool], None]) -> None:
        """Called with False when the last healthy worker is lost."""
        self._on_health_change = listener

    def start(self) -> None:
        """Start one step-loop task per worker (call from the serving loop)."""
        for slot in self._slots:
            self._tasks.append(asyncio.create_task(self._run_worker(slot), name=f"worker-{slot.index}-loop"))

    async def drain(self, grace_s: float) -> int:
        """Graceful shutdown, first half: refuse new requests, let live ones
        finish for up to ``grace_s``, then end each one left with ERROR and a message
        saying why, so every stream gets a final message instead of a bare UNAVAILABLE.
        Returns how many were ended early."""
        self._draining = True
        self._worker_up.set()  # requests waiting for a lost worker's replacement are refused
        deadline = time.monotonic() + grace_s
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        left = [r for r in self._live.values() if r is not None and not r.finished]
        for request in left:
            self.cancel(
                request.request_id,
                FinishReason.ERROR,
                f"server shutting down: stopped after a {grace_s:g} s drain; retry",
            )
        if left:
            logger.warning("shutdown: %d requests ended after the %.1f s drain", len(left), grace_s)
        return len(left)

    async def stop(self) -> None:
        """Cancel every live request, free its worker state, stop the loops."""
        self._stopping = True
        self._worker_up.set()
        for request_id in list(self._live):
            self.cancel(request_id)
        for task in [*self._tasks, *self._checking]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._checking, return_exceptions=True)
        removals = [
            self._await_remove(slot, slot.actor.remove.remote(slot.to_remove), _REMOVE_ON_SHUTDOWN_TIMEOUT_S)
            for slot in self._slots
            if slot.healthy and slot.to_remove
        ]
        for result in await asyncio.gather(*removals, return_exceptions=True):
            if isinstance(result, BaseException):
                logger.warning("freeing sequences on shutdown failed: %r", result)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._check_executor.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        return not self._stopping and any(s.healthy for s in self._slots)

    @property
    def recovering(self) -> bool:
        """No healthy worker, but a lost one is being recovered or replaced and the wait for
        it (``EngineConfig.recovery_wait_s``) has not run out: requests wait instead of failing."""
        return (
            not self._stopping
            and not self.healthy
            and self._down_deadline is not None
            and time.monotonic() < self._down_deadline
            and any(not s.healthy and not s.gone for s in self._slots)
        )

    async def _wait_for_worker(self) -> None:
        """Wait (bounded) for a healthy worker while a lost one is recovered; Unavailable if
        none is, or none comes back within the recovery wait."""
        while not self.healthy:
            if self._stopping or self._draining:
                raise ShuttingDown("the server is shutting down")
            if not self.recovering:
                raise Unavailable(self._no_worker_message())
            assert self._down_deadline is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._worker_up.wait(), max(0.0, self._down_deadline - time.monotonic()))

    def _no_worker_message(self) -> str:
        if any(not s.gone for s in self._slots) and self._config.recovery_wait_s > 0:
            return (
                f"no healthy GPU worker: none came back within {self._config.recovery_wait_s:g} s "
                "(a lost worker is being replaced); retry"
            )
        return "no healthy GPU worker left"

    def worker_health(self) -> list[bool]:
        """Per worker, in index order: whether it is in placement."""
        return [s.healthy for s in self._slots]

    @property
    def queue_depth(self) -> int:
        return self._validating + len(self._waiting)

    def num_live(self) -> int:
        """Requests admitted or validating and not finished (0 when idle: nothing leaked)."""
        return len(self._live)

    # ---- requests --------------------------------------------------------

    async def submit(self, req: GenerationRequest) -> Request:
        """Validate and queue a request; raises a ``RequestError`` when refused."""
        arrival = time.monotonic()
        if self._stopping or self._draining:
            raise ShuttingDown("the server is shutting down")
        if not self.healthy and not self.recovering:
            raise Unavailable(self._no_worker_message())
        # Requests still validating count against the bound (their memory is held), but so
        # do the batch slots free for them: a burst that fits the free slots plus the queue
        # is admitted however slow validation is at that moment.
        if self.queue_depth >= self._config.max_queue + self._free_slots():
            raise Overloaded(f"admission queue is full ({self._config.max_queue} requests waiting); retry later")
        self._config.prompt_token_bounds.check_queue(self._queued_prompt_tokens(), 1)
        if req.request_id in self._live:
            raise DuplicateRequestId(f"request_id {req.request_id!r} is already in flight")
        cap = self._config.max_inflight_per_client
        if cap and req.client and self._per_client[req.client] >= cap:
            raise Overloaded(f"this client already has {cap} requests in flight (the per-client limit); retry later")
        self._live[req.request_id] = None
        if req.client:
            self._client_of[req.request_id] = req.client
            self._per_client[req.client] += 1
        self._validating += 1
        self._publish_load()
        try:
            if not self.healthy:
                # A lost worker is being replaced: wait for it (bounded), counted in the queue.
                await self._wait_for_worker()
            loop = asyncio.get_running_loop()
            validated = await loop.run_in_executor(self._executor, self._validator.validate_request, req)
        except BaseException:
            del self._live[req.request_id]
            self._release_client(req.request_id)
            raise
        finally:
            self._validating -= 1
            self._publish_load()
        if self._stopping or not (self.healthy or self.recovering):
            del self._live[req.request_id]
            self._release_client(req.request_id)
            raise Unavailable(self._no_worker_message())
        seq = validated.seq
        try:
            self._config.prompt_token_bounds.check_queue(self._queued_prompt_tokens(), len(seq.prompt_token_ids))
        except Overloaded:
            del self._live[req.request_id]
            self._release_client(req.request_id)
            raise
        request = Request(
            seq,
            tokenizer=self._tokenizer,
            stop=req.sampling.stop,
            arrival_time=arrival,
            grammar=validated.grammar,
            max_attempts=validated.max_attempts,
            stop_may_end=(self._stop_may_end(validated) if req.sampling.stop or req.sampling.stop_token_ids else None),
            stop_token_ids=req.sampling.stop_token_ids,
            include_stop=req.sampling.include_stop_str_in_output,
        )
        self._live[request.request_id] = request
        request.admitted_time = time.monotonic()
        self._metrics.admission.observe(request.admitted_time - arrival)
        self._waiting.append(request)
        request.log.info(
            "admitted: %d prompt tokens, max_tokens=%d, grammar=%s, speculation k=%d",
            len(seq.prompt_token_ids),
            seq.sampling.max_tokens,
            seq.grammar.kind.value if seq.grammar else "none",
            seq.speculation.k if seq.speculation.enabled else 0,
        )
        self._place()
        return request

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED, error: str | None = None) -> None:
        """Finish a live request (CANCELLED, or ``reason``) now; its worker state is freed on the next iteration.

        A no-op for unknown or finished requests, so callers may always call it on the way out.
        """
        request = self._live.get(request_id)
        if request is None or request.finished:
            return
        slot = self._slot_of.get(request_id)
        if slot is None:
            self._waiting.remove(request)
        elif request in slot.to_add:
            slot.to_add.remove(request)  # placed, but its add() was never sent: nothing to remove
        else:
            slot.running.pop(request_id, None)
            slot.to_remove.append(request_id)
            slot.wake.set()
        request.log.info("cancelled" if error is None else f"ended: {error}")
        self._finish(request, reason, error)

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        request.finish(reason, error)
        if request.grammar is not None:
            self._metrics.grammar_requests.labels(enforcement=request.grammar.enforcement).inc()
        self._live.pop(request.request_id, None)
        self._release_client(request.request_id)
        self._slot_of.pop(request.request_id, None)
        assert request.finish_time is not None  # set by Request.finish
        self._metrics.observe_finish(
            reason, request.usage, request.arrival_time, request.first_token_time, request.finish_time
        )
        self._place()

    def _release_client(self, request_id: str) -> None:
        client = self._client_of.pop(request_id, None)
        if client is not None:
            self._per_client[client] -= 1
            if self._per_client[client] <= 0:
                del self._per_client[client]
                self._client_idle_since[client] = time.monotonic()
                linger = self._config.fair_share_linger_s
                if linger > 0:
                    # When its linger ends, the share it kept may go to the others.
                    with contextlib.suppress(RuntimeError):  # no loop: nothing waits to be placed
                        asyncio.get_running_loop().call_later(linger, self._place)

    def _publish_load(self) -> None:
        """The load gauges (queue, placed requests, batch-slot usage) from the state now."""
        healthy = [s for s in self._slots if s.healthy]
        budgeted = [(s, s.info.kv_budget) for s in healthy if s.info.kv_budget is not None]
        kv_usage = None
        if budgeted:
            reserved = sum(budget.reserved(_kv_needs(s, budget)) for s, budget in budgeted)
            kv_usage = reserved / sum(budget.positions for _, budget in budgeted)
        self._metrics.observe_load(
            waiting=self.queue_depth,
            running=sum(s.load for s in healthy),
            slots=sum(s.capacity for s in healthy),
            kv_usage=kv_usage,
        )

    def _queued_prompt_tokens(self) -> int:
        return sum(len(r.seq.prompt_token_ids) for r in self._waiting)

    def _free_slots(self) -> int:
        """Batch slots on healthy workers not yet taken by a running or placed request."""
        return sum(max(0, s.capacity - s.load) for s in self._slots if s.healthy)

    def _place(self) -> None:
        """Move waiting requests to the least-loaded healthy workers with free slots; each goes
        with its worker's next iterate() call (an idle worker's loop is woken for it)."""
        bounds = self._config.prompt_token_bounds
        while self._waiting and not self._stopping:
            request = self._next_waiting()
            if request is None:
                break
            n = len(request.seq.prompt_token_ids)
            candidates = [
                s
                for s in self._slots
                if s.healthy and s.load < s.capacity and bounds.fits_worker(s.prompt_tokens, n) and _kv_fits(s, request)
            ]
            if not candidates:
                # It waits at its place in the queue for room in a worker's batch (slots, prompt
                # tokens, KV memory), and the ones behind it wait too: a long request is not
                # overtaken for ever by short ones that keep fitting before it.
                break
            self._waiting.remove(request)
            slot = min(candidates, key=lambda s: s.load)
            slot.to_add.append(request)
            self._slot_of[request.request_id] = slot
            slot.wake.set()
        self._publish_load()

    def _next_waiting(self) -> Request | None:
        """The next request to place, left in the queue for ``_place`` to take
        (orchestrator.placement): the oldest waiting one of the client holding the fewest batch
        slots, among the clients it keeps within their share of the batch; None when no waiting
        client may place another now."""
        if not self._config.fair_placement:
            return self._waiting[0]
        healthy = [s for s in self._slots if s.healthy]
        capacity = BatchLoad(sum(s.capacity for s in healthy), sum(self._iteration_rows(s) for s in healthy))
        held: dict[str, BatchLoad] = collections.defaultdict(BatchLoad)
        for rid in self._slot_of:
            placed = self._live.get(rid)
            client = self._client_of.get(rid, "")
            held[client] = held[client].plus(self._rows(placed) if placed is not None else step_rows(0))
        share = client_share(capacity, len(self._clients_with_work()))
        waiting = ((r, self._client_of.get(r.request_id, ""), self._rows(r)) for r in self._waiting)
        return next_to_place(waiting, held, share)

    def _clients_with_work(self) -> set[str]:
        """Clients with a live request (validating, waiting or placed), or whose last one ended
        within ``fair_share_linger_s``."""
        clients = {self._client_of.get(rid, "") for rid in self._live}
        now, linger = time.monotonic(), self._config.fair_share_linger_s
        for client, since in list(self._client_idle_since.items()):
            if client in clients or now - since >= linger:
                del self._client_idle_since[client]
            else:
                clients.add(client)
        return clients

    def _iteration_rows(self, slot: WorkerSlot) -> int:
        """The rows one iteration of ``slot``'s worker takes before it trims drafts (its budget,
        gpu_worker.config.iteration_budget), or its full batch's rows when that is fewer."""
        budget = self._config.max_iteration_tokens
        if budget <= 0:
            budget = GPU_ITERATION_TOKENS if slot.info.device.startswith("cuda") else CPU_ITERATION_TOKENS
        return min(budget, slot.capacity * step_rows(slot.info.max_k))

    @staticmethod
    def _rows(request: Request) -> int:
        spec = request.seq.speculation
        return step_rows(spec.k if spec.enabled else 0)

    # ---- step loop -------------------------------------------------------

    async def _run_worker(self, slot: WorkerSlot) -> None:
        while not self._stopping and slot.healthy:
            slot.wake.clear()
            if not slot.has_work():
                await slot.wake.wait()
                continue
            try:
                await self._iterate(slot)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._on_worker_failure(slot, exc)
            self._metrics.running.labels(worker=str(slot.index)).set(len(slot.running))
            self._publish_load()

    async def _iterate(self, slot: WorkerSlot) -> None:
        """One round on one worker, one Ray call: ``iterate()`` removes what finished here,
        adds what was placed since the last call, and steps (a bare ``remove()`` when nothing
        is left to step).

        Adds placed while a step runs wait for the next call: the worker could not take them
        sooner (an actor runs one call at a time), and each Ray call costs both processes
        CPU; sent one per placement, a flood of short requests (bench.soak,
        ~2 arrivals a step) made each iteration three calls. The worker starts their
        mask-session opens in the call and steps at once: a sequence whose open answers while
        the drafts are proposed joins that step, else it sits the step out."""
        removes, slot.to_remove = slot.to_remove, []
        adds, slot.to_add = slot.to_add, []
        now = time.monotonic()
        for request in adds:
            slot.running[request.request_id] = request
            if request.scheduled_time is None:  # a checked-mode retry is not queued again
                request.scheduled_time = now
                self._metrics.observe_queued(now - (request.admitted_time or now))
        timeout = self._config.step_timeout_s
        if not slot.running:
            if removes:
                await self._await_remove(slot, slot.actor.remove.remote(removes), timeout)
            return
        started = time.monotonic()
        try:
            result: Iteration = await self._await_live(slot, slot.actor.iterate.remote(removes, [r.seq for r in adds]))
        except RayTaskError as exc:
            # A worker method raised: the actor is alive, but this batch's
            # state is suspect. Fail the batch, free it, keep the worker.
            self._fail_batch(slot, f"worker call failed: {_describe(exc)}")
            return
        if result.unknown_removed:
            logger.debug("worker %d no longer held %s", slot.index, result.unknown_removed)
        for request, add_error in zip(adds, result.add_errors, strict=True):
            # A refused sequence never became active on the worker: nothing to remove.
            if add_error is not None and slot.running.pop(request.request_id, None) is not None:
                self._finish(request, FinishReason.ERROR, f"worker refused the request: {add_error}")
        self._metrics.observe_step(slot.index, time.monotonic() - started, result.outputs, slot.running)
        self._apply(slot, result.outputs)

    async def _await_live(self, slot: WorkerSlot, ref: Any) -> Any:
        """Await a worker call for as long as the worker is alive and making progress.

        Every liveness limit (``step_timeout_s``) the call has not answered, the worker's
        heartbeat is asked (``GpuWorker.progress``, answered on its own thread): a heartbeat
        that does not answer within the limit means the worker stopped (SIGSTOP, a wedged
        process or node) and raises TimeoutError; one that answers with a progress count that
        has not moved for ``_STALL_LIMITS`` limits means a hung iteration, also TimeoutError.
        A worker that is merely slow (a long iteration on a busy CPU) is waited for."""
        call = asyncio.ensure_future(asyncio.wrap_future(ref.future()))
        limit = self._config.step_timeout_s
        last: WorkerProgress | None = None
        started = moved = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=limit)
                if done:
                    return call.result()
                beat = slot.actor.progress.options(concurrency_group=LIVENESS_GROUP).remote()
                progress: WorkerProgress = await _ray_get(beat, limit)
                now = time.monotonic()
                if last is None or progress.count != last.count:
                    moved = now
                elif now - moved > _STALL_LIMITS * limit:
                    raise TimeoutError(f"no progress in {now - moved:.0f} s")
                last = progress
                logger.warning(
                    "worker %d: call running for %.0f s; alive (progress %d, %d sequences)",
                    slot.index,
                    now - started,
                    progress.count,
                    progress.active,
                )
        finally:
            call.cancel()

    @staticmethod
    async def _await_remove(slot: WorkerSlot, ref: Any, timeout: float) -> None:
        """Ids the worker no longer holds are expected, not errors.

        A request can finish on the worker (grammar complete, length) in the
        same step in which the client cancels it, or be refused by add() while
        its cancel is queued; the worker frees the rest and names those.
        """
        try:
            await _ray_get(ref, timeout)
        except RayTaskError as exc:
            if not isinstance(getattr(exc, "cause", None), UnknownSequenceError):
                raise
            logger.debug("worker %d: %s", slot.index, exc.cause)

    def _apply(self, slot: WorkerSlot, outputs: list[StepOutput]) -> None:
        for out in outputs:
            request = slot.running.get(out.seq_id)
            if request is None:
                continue  # cancelled while this step was in flight; remove() is queued
            previous = request.last_token_time
            hit_stop_string = request.apply_step(out)
            now = request.last_token_time
            if previous is not None and now is not None and now != previous:  # tokens reached the client
                self._metrics.observe_tokens_after_first(now - previous, len(out.new_token_ids))
            if hit_stop_string and request.seq.grammar is not None:
                # Before the worker's own finish: the stop match ended the output first.
                del slot.running[out.seq_id]
                if out.finish_reason is None:
                    slot.to_remove.append(out.seq_id)
                self._finish_checked(request, FinishReason.STOP)
                continue
            if out.finish_reason is not None:
                # The worker already freed this sequence.
                del slot.running[out.seq_id]
                if out.finish_reason is FinishReason.GRAMMAR_COMPLETE and request.seq.grammar is not None:
                    self._finish_checked(request)
                    continue
                if out.finish_reason is FinishReason.GRAMMAR_VIOLATION:
                    self._metrics.grammar_violations.labels(stage="device").inc()
                    self._log_violation(request, "device", out.error or "")
                reason = out.finish_reason
                if hit_stop_string and reason is FinishReason.LENGTH:
                    # A stop string or stop token in the step that reached max_tokens ended the
                    # output first (its text is cut there): "stop", as vLLM reports it.
                    reason = FinishReason.STOP
                self._finish(request, reason, out.error)
            elif hit_stop_string:
                del slot.running[out.seq_id]
                slot.to_remove.append(out.seq_id)
                self._finish(request, FinishReason.STOP)

    def _stop_may_end(self, validated: ValidatedRequest) -> Callable[[str], bool] | None:
        """For a grammar request with stop strings: whether its output may end with a text
        (the end check, run on the loop: only at a stop match, at most MAX_END_CHECKS times)."""
        spec = validated.seq.grammar
        if spec is None:
            return None
        engine = validated.grammar.backend if validated.grammar is not None else ""
        checker = self.output_checker

        def may_end(text: str) -> bool:
            try:
                return checker.check(spec, text, engine).ok
            except OutputCheckError:
                return False

        return may_end

    def _finish_checked(self, request: Request, reason: FinishReason = FinishReason.GRAMMAR_COMPLETE) -> None:
        """Finish a grammar request the worker calls complete (or a stop string ended: ``reason``
        STOP), once its text passes the end check."""
        assert request.seq.grammar is not None
        spec = request.seq.grammar
        if reason is FinishReason.STOP:
            text = request.stop_text
        else:
            text = self._tokenizer.decode(list(request.token_ids), skip_special_tokens=True)
        engine = request.grammar.backend if request.grammar is not None else ""

        def check() -> Verdict:
            try:
                return self.output_checker.check(spec, text, engine)
            except OutputCheckError as exc:  # fail closed: unverifiable is not valid
                return Verdict(False, f"the output could not be verified ({exc})")

        async def run() -> None:
            try:
                verdict = await asyncio.get_running_loop().run_in_executor(self._check_executor, check)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # e.g. the executor is gone: still never a success
                verdict = Verdict(False, f"the output could not be verified ({exc!r})")
            if request.finished:  # cancelled meanwhile
                return
            checked = request.grammar is not None and request.grammar.checked
            if verdict.ok:
                if checked:
                    self._metrics.checked_attempts.labels(outcome="passed").inc()
                self._finish(request, reason)
                return
            if checked:  # checked mode: the relaxation allowed it; the end check caught it
                if request.may_resample:
                    self._metrics.checked_attempts.labels(outcome="resampled").inc()
                    self._resample(request, verdict.reason)
                    return
                self._metrics.checked_attempts.labels(outcome="exhausted").inc()
                self._finish(request, FinishReason.GRAMMAR_VIOLATION, _exhausted(request, verdict.reason))
                return
            self._metrics.grammar_violations.labels(stage="output_check").inc()
            self._log_violation(request, "output_check", verdict.reason)
            self._finish(request, FinishReason.GRAMMAR_VIOLATION, f"grammar violation: {verdict.reason}")

        task = asyncio.create_task(run(), name=f"output-check-{request.request_id}")
        self._checking.add(task)
        task.add_done_callback(self._checking.discard)

    def _resample(self, request: Request, reason: str) -> None:
        """Checked mode: discard the held attempt and queue the request again with a fresh seed."""
        request.log.info("checked mode: attempt %d failed the end check (%s); resampling", request.attempts, reason)
        request.restart(dataclasses.replace(request.seq, sampling=_fresh_seed(request.seq.sampling, request.attempts)))
        self._slot_of.pop(request.request_id, None)  # the worker freed it when it reported completion
        self._waiting.appendleft(request)  # it was admitted already: first in line
        self._place()

    @staticmethod
    def _log_violation(request: Request, stage: str, reason: str) -> None:
        spec = request.seq.grammar
        request.log.error(
            "GRAMMAR VIOLATION caught by %s: grammar %s hash=%s: %s",
            stage,
            spec.kind.value if spec is not None else "none",
            spec.cache_key()[:16] if spec is not None else "-",
            reason,
        )

    def _fail_batch(self, slot: WorkerSlot, message: str) -> None:
        logger.error("worker %d: %s", slot.index, message)
        failed = list(slot.running.values())
        slot.running.clear()
        slot.to_remove.extend(r.request_id for r in failed)
        for request in failed:
            self._finish(request, FinishReason.ERROR, message)

    def _on_worker_failure(self, slot: WorkerSlot, exc: BaseException) -> None:
        """The worker died or stopped answering: take it out, fail what it held. Once per
        loss: a slot already out (e.g. its loop's call fails after placement found it
        broken) is being recovered already."""
        if not slot.healthy:
            logger.info("worker %d: already out of placement: %s", slot.index, _describe(exc))
            return
        timed_out = isinstance(exc, (asyncio.TimeoutError, TimeoutError))
        logger.error(
            "worker %d %s; taking it out of placement", slot.index, "timed out" if timed_out else f"failed: {exc!r}"
        )
        # The client gets what happened in SpecMask's words; Ray's exception text
        # ("ActorUnavailableError ... recvmsg") stays in the log above.
        what = (
            f"stopped answering (no heartbeat or no progress within {self._config.step_timeout_s:g} s)"
            if timed_out
            else "was lost (its process died or became unreachable)"
        )
        slot.healthy = False
        self._metrics.worker_failures.labels(worker=str(slot.index)).inc()
        held = list(slot.running.values())
        slot.running.clear()
        slot.to_remove.clear()
        # Requests that have generated nothing yet (prefilling, or never stepped) lose nothing
        # by starting over: with the ones placed here while its last call ran, never sent, they
        # go back to the head of the line, in order, for another worker (or are failed below
        # with the rest if none is left). A request that has produced tokens cannot be replayed
        # without sending them twice (or, sampled, differently): it ends with an error.
        unstarted = [r for r in held if not r.token_ids]
        lost = [r for r in held if r.token_ids]
        for request in reversed([*unstarted, *slot.to_add]):
            self._slot_of.pop(request.request_id, None)
            self._waiting.appendleft(request)
        slot.to_add.clear()
        if unstarted:
            logger.warning("worker %d: %d requests that had not started are queued again", slot.index, len(unstarted))
            self._metrics.requeued.inc(len(unstarted))
        for request in lost:
            self._finish(request, FinishReason.ERROR, f"GPU worker {slot.index} {what}; the request was cut off")
        if self._release_sessions is not None and slot.info.session_owner and not self._stopping:
            # Its requests are finished, so their mask sessions are garbage. Release them
            # now: a worker that never comes back (restarts used up, or hung) would
            # otherwise hold them until the service's idle TTL.
            slot.release = asyncio.create_task(self._release_worker_sessions(slot), name=f"worker-{slot.index}-release")
            self._tasks.append(slot.release)
        healthy = sum(s.healthy for s in self._slots)
        self._metrics.healthy_workers.set(healthy)
        if not healthy:
            self._worker_up.clear()
            if self._on_health_change is not None:
                self._on_health_change(False)
            if not self._stopping and self._config.recovery_wait_s > 0:
                # What is queued waits for the recovery below, up to the bound.
                self._down_deadline = time.monotonic() + self._config.recovery_wait_s
                self._tasks.append(asyncio.create_task(self._end_wait(self._down_deadline), name="recovery-wait"))
            else:
                self._fail_waiting()
        self._place()
        if not self._stopping:
            self._tasks.append(asyncio.create_task(self._recover(slot), name=f"worker-{slot.index}-recover"))

    def _fail_waiting(self) -> None:
        """No worker is healthy and none is coming back within the wait: fail what is queued
        (submit() refuses new requests), and wake the requests waiting in submit()."""
        message = self._no_worker_message()
        for request in list(self._waiting):
            self._waiting.remove(request)
            self._finish(request, FinishReason.ERROR, message)
        self._down_deadline = None
        self._worker_up.set()  # waiters re-check, and are refused

    async def _end_wait(self, deadline: float) -> None:
        """At the end of the recovery wait: if still no worker is healthy, fail what waits."""
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        if self._down_deadline == deadline and not self.healthy and not self._stopping:
            logger.error("no GPU worker back within %g s; failing the queued requests", self._config.recovery_wait_s)
            self._fail_waiting()

    async def _release_worker_sessions(self, slot: WorkerSlot) -> None:
        assert self._release_sessions is not None
        try:
            closed = await asyncio.to_thread(self._release_sessions, slot.info.session_owner)
        except Exception as exc:  # the sessions then expire by TTL
            logger.warning("worker %d: releasing its mask sessions failed: %s", slot.index, exc)
            return
        logger.info("worker %d: released %d mask sessions it held", slot.index, closed)

    async def _recover(self, slot: WorkerSlot) -> None:
        """Bring a lost worker back: probe it until it answers (Ray restarted a crashed actor, a
        stopped process continued), or replace it: kill its actor and start a new one, at once
        when the actor is dead for good, else once it has not answered for a liveness limit.
        Replacements are bounded (``_REPLACE_ATTEMPTS`` per loss, with backoff;
        ``EngineConfig.max_restarts`` over the worker's life); a worker that cannot come back
        is given up (``WorkerSlot.gone``). Once back it is reset, checked to serve the same
        model, and put back into placement."""
        lost_at = time.monotonic()
        delay = _RECOVERY_PROBE_S
        failed_starts = 0
        while not self._stopping:
            await asyncio.sleep(delay)
            delay = min(2 * delay, _RECOVERY_PROBE_MAX_S)
            try:
                info: WorkerInfo = await _ray_get(slot.actor.info.remote(), self._config.step_timeout_s)
                # Requests it held were failed already; a restarted actor holds none,
                # a hung one that came back still does.
                freed = await _ray_get(slot.actor.reset.remote(), self._config.step_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                dead = isinstance(exc, ActorDiedError)
                logger.info("worker %d not back yet%s: %s", slot.index, " (dead)" if dead else "", _describe(exc))
                if not self._may_replace(slot):
                    if dead:  # nothing can bring it back
                        self._give_up(slot, "its actor is dead and no restart is left (--worker-max-restarts)")
                        return
                    continue
                if not dead and time.monotonic() - lost_at < self._config.step_timeout_s:
                    continue  # Ray may be restarting it: give that a liveness limit
                try:
                    info = await self._start_replacement(slot)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    failed_starts += 1
                    logger.error(
                        "worker %d: starting a replacement failed (%d of %d): %s",
                        slot.index,
                        failed_starts,
                        _REPLACE_ATTEMPTS,
                        _describe(exc),
                    )
                    if failed_starts >= _REPLACE_ATTEMPTS:
                        self._give_up(slot, f"{_REPLACE_ATTEMPTS} replacements failed to start")
                        return
                    delay = min(_REPLACE_BACKOFF_S * 2 ** (failed_starts - 1), _REPLACE_BACKOFF_MAX_S)
                    continue
                freed = 0
            if not info.serves_same_model(slot.info):
                logger.error("worker %d came back with a different model (%s); leaving it out", slot.index, info)
                self._give_up(slot, "it came back with a different model")
                return
            if slot.release is not None:
                # Finish releasing the old sessions first: once the worker is back in
                # placement, its owner's sessions are live ones.
                await slot.release
                slot.release = None
            was_down = not self.healthy
            slot.info = info
            slot.healthy = True
            self._down_deadline = None
            self._worker_up.set()
            self._metrics.worker_recoveries.labels(worker=str(slot.index)).inc()
            healthy = sum(s.healthy for s in self._slots)
            self._metrics.healthy_workers.set(healthy)
            self._publish_load()
            logger.warning("worker %d is back (pid %d, freed %d stale sequences)", slot.index, info.pid, freed)
            if was_down and self._on_health_change is not None:
                self._on_health_change(True)
            self._tasks.append(asyncio.create_task(self._run_worker(slot), name=f"worker-{slot.index}-loop"))
            self._place()
            return

    def _may_replace(self, slot: WorkerSlot) -> bool:
        limit = self._config.max_restarts
        return self._replace_worker is not None and (limit < 0 or slot.restarts < limit)

    async def _start_replacement(self, slot: WorkerSlot) -> WorkerInfo:
        """Kill the lost worker's actor and start a new one in its slot (counted once started)."""
        assert self._replace_worker is not None
        logger.warning("worker %d: replacing its actor (restart %d)", slot.index, slot.restarts + 1)
        actor, info = await self._replace_worker(slot.actor)
        slot.actor = actor
        slot.restarts += 1
        self._metrics.worker_restarts.labels(worker=str(slot.index)).inc()
        return info

    def _give_up(self, slot: WorkerSlot, why: str) -> None:
        """The worker will not come back: leave it out for good; with no other worker healthy or
        recovering, fail what waits for one."""
        logger.error("worker %d is lost for good: %s", slot.index, why)
        slot.gone = True
        if not self.healthy and not any(not s.healthy and not s.gone for s in self._slots):
            self._fail_waiting()


def _kv_needs(slot: WorkerSlot, budget: KVBudget) -> list[int]:
    """Positions per slot each request placed on ``slot`` reserves (gpu_worker.kv_budget): the
    worker holds a superset of them at each add(), which removes before it adds."""
    return [
        budget.need(len(r.seq.prompt_token_ids), r.seq.sampling.max_tokens)
        for r in (*slot.running.values(), *slot.to_add)
    ]


def _kv_fits(slot: WorkerSlot, request: Request) -> bool:
    """Whether ``request`` fits ``slot``'s KV budget beside what is placed there (no budget: yes)."""
    budget = slot.info.kv_budget
    if budget is None:
        return True
    needs = _kv_needs(slot, budget)
    needs.append(budget.need(len(request.seq.prompt_token_ids), request.seq.sampling.max_tokens))
    return budget.fits(needs)


def _fresh_seed(sampling: SamplingParams, attempt: int) -> SamplingParams:
    """The sampling of attempt ``attempt + 1``: a seeded request derives its seeds (so it replays
    exactly), an unseeded one draws a new one."""
    if sampling.seed is None:
        seed = secrets.randbits(63)
    else:
        seed = (sampling.seed + attempt * _SEED_STRIDE) & ((1 << 63) - 1)
    return dataclasses.replace(sampling, seed=seed)


def _exhausted(request: Request, reason: str) -> str:
    if request.max_attempts == 1 and request.seq.sampling.temperature == 0.0:
        why = "greedy decoding is deterministic, so a resample would repeat this output; send temperature > 0"
        return f"grammar violation (checked mode, 1 attempt: {why}): {reason}"
    return f"grammar violation (checked mode, all {request.attempts} attempts failed the end check; last: {reason})"


async def _ray_get(ref: Any, timeout_s: float) -> Any:
    """Await a Ray ObjectRef on the running loop, with a timeout (never a bare ray.get)."""
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)


def _describe(exc: BaseException) -> str:
    """One line for a client: the worker-side exception, not Ray's traceback."""
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
