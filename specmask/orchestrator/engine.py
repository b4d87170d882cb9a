"""Admission and the step loop: continuous batching over GPU workers.

Life of a request:

1. ``submit`` checks the admission bound (RESOURCE_EXHAUSTED past it),
   validates on a thread pool (tokenize, sampling checks, ValidateGrammar on
   the mask service) and queues the request as *waiting*.
2. Placement (``placement.Placer``) moves waiting requests onto the least-loaded
   healthy worker with a free batch slot, fairly between clients; they go with that
   worker's next iteration (an idle worker's loop is woken at once).
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
   every step. Where each live request is, and every way one ends or goes back in
   line, is ``live_requests.LiveRequests``.

A sequence-level error from the worker finishes only that request (ERROR). A
failed ``step`` call finishes that worker's batch with ERROR; a dead or
unresponsive worker is taken out of placement (``supervision.WorkerSupervisor``):
its requests that had streamed tokens finish with ERROR, the others go back to the
head of the queue, and the server keeps serving while any worker is healthy; the
supervisor probes, resets or replaces the lost worker and puts it back.

Never lie: a grammar request the worker reports GRAMMAR_COMPLETE, or a stop string
ended, is finished only after its final text passes the end check
(``checked_retry.EndCheck``; checked mode resamples there). A violation the worker
caught on device arrives as GRAMMAR_VIOLATION already. See docs/design.md,
"Who runs what".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray.exceptions import RayTaskError

from specmask.common import tracing
from specmask.gpu_worker.types import FinishReason, Iteration, StepOutput, WorkerInfo
from specmask.orchestrator.checked_retry import EndCheck, log_violation
from specmask.orchestrator.detokenizer import Decoder
from specmask.orchestrator.engine_config import EngineConfig
from specmask.orchestrator.errors import Overloaded, ShuttingDown, Unavailable
from specmask.orchestrator.live_requests import LiveRequests
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.output_check import OutputChecker
from specmask.orchestrator.placement import free_slots, kv_usage
from specmask.orchestrator.request import Request
from specmask.orchestrator.request_trace import IterationTraces
from specmask.orchestrator.step_outcome import Settle, step_outcome
from specmask.orchestrator.supervision import ReplaceWorker, WorkerSupervisor, await_live
from specmask.orchestrator.types import GenerationRequest
from specmask.orchestrator.validation import RequestValidator
from specmask.orchestrator.worker_calls import await_remove, describe
from specmask.orchestrator.worker_scaling import PoolLoad
from specmask.orchestrator.worker_slot import WorkerSlot

__all__ = ["Engine", "EngineConfig", "WorkerSlot"]

logger = logging.getLogger(__name__)
# How often drain() looks whether the live requests have finished.
_DRAIN_POLL_S = 0.05
# On shutdown, remove() frees what the workers still hold: fast (KV caches,
# session closes), though it may queue behind one in-flight step. Bounded so a
# stuck worker cannot hold shutdown up; the workers are killed right after.
_REMOVE_ON_SHUTDOWN_TIMEOUT_S = 10.0


class Engine:
    """Admits requests and runs one step loop per worker (live requests: ``LiveRequests``), on one loop."""

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
        replace_worker: ReplaceWorker | None = None,
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
        self._requests = LiveRequests(self._slots, metrics, lambda: self._config, self._place)
        self.output_checker = output_checker if output_checker is not None else OutputChecker()
        self._end_check = EndCheck(
            self.output_checker, tokenizer, metrics, finish=self._requests.finish, resample=self._requests.resample
        )
        self._supervisor = WorkerSupervisor(
            self._slots, config, metrics, self, release_sessions=release_sessions, replace_worker=replace_worker
        )
        self._draining = False
        self._executor = ThreadPoolExecutor(config.validation_threads, thread_name_prefix="validate")
        self._validating = 0
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._metrics.healthy_workers.set(len(self._slots))
        self._publish_load()

    # ---- lifecycle -------------------------------------------------------

    def set_health_listener(self, listener: Callable[[bool], None]) -> None:
        """Called with False when the last healthy worker is lost, True when one is back."""
        self._supervisor.set_health_listener(listener)

    def start(self) -> None:
        """Start one step-loop task per worker (call from the serving loop)."""
        for slot in self._slots:
            self._start_loop(slot)

    def add_worker(self, actor: Any, info: WorkerInfo, capacity: int) -> WorkerSlot:
        """Put a newly started, loaded worker into placement (supervision.WorkerSupervisor.add)."""
        return self._supervisor.add(actor, info, capacity)

    async def retire_worker(self) -> Any | None:
        """Take a worker out once its batch is done; its actor, or None (WorkerSupervisor.retire)."""
        return await self._supervisor.retire()

    def worker_actors(self) -> list[Any]:
        """The actors of the workers the engine drives now."""
        return [s.actor for s in self._slots]

    def pool_load(self) -> PoolLoad:
        """The load worker autoscaling reads (worker_scaling.WorkerScaler): workers in placement or
        being recovered, the oldest admitted request's wait for a batch slot, requests placed."""
        now = time.monotonic()
        waits = [now - r.admitted_time for r in self._requests.waiting if r.admitted_time is not None]
        return PoolLoad(
            workers=sum(1 for s in self._slots if not s.gone and not s.retiring),
            oldest_wait_s=max(waits, default=0.0),
            running=sum(s.load for s in self._slots if s.healthy),
        )

    def _start_loop(self, slot: WorkerSlot) -> None:
        slot.loop = asyncio.create_task(self._run_worker(slot), name=f"worker-{slot.index}-loop")
        self._tasks.append(slot.loop)

    async def drain(self, grace_s: float) -> int:
        """Graceful shutdown, first half: refuse new requests, let live ones
        finish for up to ``grace_s``, then end each one left with ERROR and a message
        saying why, so every stream gets a final message instead of a bare UNAVAILABLE.
        Returns how many were ended early."""
        self._draining = True
        self._supervisor.release_waiters()  # requests waiting for a lost worker's replacement are refused
        deadline = time.monotonic() + grace_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        left = self._requests.unfinished()
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
        supervision = self._supervisor.stop()
        for request_id in list(self._requests.live):
            self.cancel(request_id)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, *supervision, self._end_check.stop(), return_exceptions=True)
        removals = [
            await_remove(slot.index, slot.actor.remove.remote(slot.to_remove), _REMOVE_ON_SHUTDOWN_TIMEOUT_S)
            for slot in self._slots
            if slot.healthy and slot.to_remove
        ]
        for result in await asyncio.gather(*removals, return_exceptions=True):
            if isinstance(result, BaseException):
                logger.warning("freeing sequences on shutdown failed: %r", result)
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        return not self._stopping and self._supervisor.healthy

    @property
    def recovering(self) -> bool:
        """No healthy worker, but a lost one is being recovered or replaced and the wait for
        it (``EngineConfig.recovery_wait_s``) has not run out: requests wait instead of failing."""
        return not self._stopping and self._supervisor.recovering

    def worker_health(self) -> list[bool]:
        """Per worker, in index order: whether it is in placement."""
        return [s.healthy for s in self._slots]

    @property
    def queue_depth(self) -> int:
        return self._validating + len(self._requests.waiting)

    def num_live(self) -> int:
        """Requests admitted or validating and not finished (0 when idle: nothing leaked)."""
        return len(self._requests)

    # ---- requests --------------------------------------------------------

    async def submit(self, req: GenerationRequest) -> Request:
        """Validate and queue a request; raises a ``RequestError`` when refused."""
        arrival = time.monotonic()
        if self._stopping or self._draining:
            raise ShuttingDown("the server is shutting down")
        if not self.healthy and not self.recovering:
            raise Unavailable(self._supervisor.no_worker_message())
        # Requests still validating count against the bound (their memory is held), but so
        # do the batch slots free for them: a burst that fits the free slots plus the queue
        # is admitted however slow validation is at that moment.
        if self.queue_depth >= self._config.max_queue + free_slots(self._slots):
            raise Overloaded(f"admission queue is full ({self._config.max_queue} requests waiting); retry later")
        self._config.prompt_token_bounds.check_queue(self._requests.queued_prompt_tokens(), 1)
        self._requests.reserve(req)
        self._validating += 1
        self._publish_load()
        try:
            if not self.healthy:
                # A lost worker is being replaced: wait for it (bounded), counted in the queue.
                await self._supervisor.wait_for_worker(lambda: self._stopping or self._draining)
            loop = asyncio.get_running_loop()
            # bind: ValidateGrammar's metadata carries the caller's admission span (tracing on).
            validated = await loop.run_in_executor(self._executor, tracing.bind(self._validator.validate_request), req)
            if self._stopping or not (self.healthy or self.recovering):
                raise Unavailable(self._supervisor.no_worker_message())
            seq = validated.seq
            self._config.prompt_token_bounds.check_queue(
                self._requests.queued_prompt_tokens(), len(seq.prompt_token_ids)
            )
        except BaseException:
            self._requests.unreserve(req.request_id)
            raise
        finally:
            self._validating -= 1
            self._publish_load()
        request = Request(
            seq,
            tokenizer=self._tokenizer,
            stop=req.sampling.stop,
            arrival_time=arrival,
            grammar=validated.grammar,
            max_attempts=validated.max_attempts,
            stop_may_end=(
                self._end_check.stop_may_end(validated) if req.sampling.stop or req.sampling.stop_token_ids else None
            ),
            stop_token_ids=req.sampling.stop_token_ids,
            include_stop=req.sampling.include_stop_str_in_output,
        )
        request.admitted_time = time.monotonic()
        self._metrics.admission.observe(request.admitted_time - arrival)
        self._requests.enqueue(request)
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
        self._requests.cancel(request_id, reason, error)

    def _publish_load(self) -> None:
        """The load gauges (queue, placed requests, batch-slot usage) from the state now."""
        healthy = [s for s in self._slots if s.healthy]
        self._metrics.observe_load(
            waiting=self.queue_depth,
            running=sum(s.load for s in healthy),
            slots=sum(s.capacity for s in healthy),
            kv_usage=kv_usage(healthy),
        )

    def _place(self) -> None:
        if not self._stopping:
            self._requests.placer.place(self._config)
        self._publish_load()

    # ---- supervision hooks (supervision.SupervisionHooks) -----------------

    def _on_worker_failure(self, slot: WorkerSlot, exc: BaseException) -> None:
        self._supervisor.on_failure(slot, exc)

    def worker_lost(self, slot: WorkerSlot, what: str) -> None:
        self._requests.worker_lost(slot, what)

    def worker_back(self, slot: WorkerSlot) -> None:
        self._publish_load()
        self._start_loop(slot)
        self._place()

    def worker_gone(self, slot: WorkerSlot) -> None:
        self._publish_load()
        self._place()

    def fail_waiting(self, message: str) -> None:
        self._requests.fail_waiting(message)

    # ---- step loop -------------------------------------------------------

    async def _run_worker(self, slot: WorkerSlot) -> None:
        while not self._stopping and slot.healthy:
            slot.wake.clear()
            if not slot.has_work():
                if slot.retiring:
                    return  # its batch is done: WorkerSupervisor.retire takes it out
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
                await await_remove(slot.index, slot.actor.remove.remote(removes), timeout)
            return
        started = time.monotonic()
        traced = IterationTraces.start(slot.index, slot.running)  # NO_ITERATION while tracing is off
        try:
            call = slot.actor.iterate.remote(removes, [r.seq for r in adds], *traced.call_args)
            result: Iteration = await await_live(slot, call, timeout)
        except RayTaskError as exc:
            # A worker method raised: the actor is alive, but this batch's
            # state is suspect. Fail the batch, free it, keep the worker.
            traced.end(failure=f"worker call failed: {describe(exc)}")
            self._requests.fail_batch(slot, f"worker call failed: {describe(exc)}")
            return
        except BaseException as exc:
            traced.end(failure=describe(exc))
            raise
        traced.end(result.outputs)
        if result.unknown_removed:
            logger.debug("worker %d no longer held %s", slot.index, result.unknown_removed)
        for request, add_error in zip(adds, result.add_errors, strict=True):
            # A refused sequence never became active on the worker: nothing to remove.
            if add_error is not None and slot.running.pop(request.request_id, None) is not None:
                self._requests.finish(request, FinishReason.ERROR, f"worker refused the request: {add_error}")
        self._metrics.observe_step(slot.index, time.monotonic() - started, result.outputs, slot.running)
        self._apply(slot, result.outputs)

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
            end = step_outcome(out.finish_reason, hit_stop=hit_stop_string, has_grammar=request.seq.grammar is not None)
            if end.settle is Settle.RUNNING:
                continue
            del slot.running[out.seq_id]
            if end.remove:
                slot.to_remove.append(out.seq_id)
            assert end.reason is not None  # set for every settle but RUNNING
            if end.settle is Settle.CHECK:
                self._end_check.finish_checked(request, end.reason)
                continue
            if end.reason is FinishReason.GRAMMAR_VIOLATION:
                self._metrics.grammar_violations.labels(stage="device").inc()
                log_violation(request, "device", out.error or "")
            self._requests.finish(request, end.reason, out.error, out.error_kind)
