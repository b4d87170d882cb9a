"""``GpuWorker``: owns the target and draft models, the sequences, and the step loop.

A plain class, so tests can use it in-process; ``ray.remote(GpuWorker)`` (or
``start_remote_worker``) makes it the per-GPU Ray actor. Ray runs an actor's
methods one at a time, so no locking is needed around sequence state.

It runs what other modules decide or do: which requests it takes (gpu_worker.admission),
their mask sessions (gpu_worker.sessions), what each iteration takes within its token
budget (gpu_worker.planning), reading prompts (gpu_worker.prefill), the decoding step
(gpu_worker.step), loading the models (gpu_worker.runners), sizing the KV budget
(gpu_worker.kv_sizing), and holding, retiring and freeing the sequences
(gpu_worker.sequence_table).

Errors: a bad sequence never takes the worker down. ``add`` returns an error
message per refused sequence; ``step`` reports a failed sequence as
``FinishReason.ERROR`` with ``StepOutput.error`` and frees it; ``remove`` of an
unknown id raises ``UnknownSequenceError`` after removing the known ones.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from specmask.common import tracing
from specmask.common.tracing import NO_SPAN, Carrier
from specmask.gpu_worker.admission import Admission, WorkerLimits
from specmask.gpu_worker.config import WorkerConfig, iteration_budget
from specmask.gpu_worker.kv_sizing import size_kv_budget
from specmask.gpu_worker.loading import eos_token_ids, load_tokenizer, resolve_device
from specmask.gpu_worker.mask_table import DeviceMaskTable
from specmask.gpu_worker.masks import MaskChannel
from specmask.gpu_worker.planning import IterationPlanner
from specmask.gpu_worker.prefill import ChunkRiders, PromptReader, plan_view
from specmask.gpu_worker.proposers.base import ProposerResources
from specmask.gpu_worker.proposers.registry import build_proposers
from specmask.gpu_worker.runners import load_runners
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.sequence_table import SequenceTable, free
from specmask.gpu_worker.sessions import MaskSessions, note_session_waits
from specmask.gpu_worker.step import StepRunner
from specmask.gpu_worker.types import (
    LIVENESS_GROUP,
    FinishReason,
    Iteration,
    NewSequence,
    StepOutput,
    UnknownSequenceError,
    WorkerInfo,
    WorkerProgress,
)
from specmask.mask_service.auth import owner_tag

logger = logging.getLogger(__name__)

WORKER_ITERATION_SPAN = "specmask.worker.iterate"  # common.tracing; docs/operations.md#tracing
WORKER_SERVICE_NAME = "specmask-gpu-worker"  # the trace's service.name of a worker process


class GpuWorker:
    def __init__(self, config: WorkerConfig, *, target_model: Any = None, draft_model: Any = None) -> None:
        """``target_model`` / ``draft_model``: causal LMs already built on the config's device and
        dtype (bench.gpu builds random-initialised ones at real shapes, with no weights on disk);
        None loads them from ``config.target_dir`` / ``config.draft_dir``, the normal path. The
        tokenizer is always read from the dirs."""
        from specmask.common.tokenizer_id import tokenizer_id_for_path

        self.config = config
        if config.log_level is not None:
            from specmask.common.log_format import configure_logging

            configure_logging(config.log_level, config.log_format)
        # Spans of this process's iterations and the mask-service calls they make (off: None).
        tracing.configure(config.otlp_traces_endpoint, WORKER_SERVICE_NAME)
        self.device = resolve_device(config.device)
        self.tokenizer = load_tokenizer(config.target_dir)
        self.target, self.draft = load_runners(
            config, self.device, self.tokenizer, target_model=target_model, draft_model=draft_model
        )
        self.vocab_size = self.target.vocab_size  # V: logits width
        self.max_model_len = self.target.max_model_len
        if config.max_model_len is not None:
            self.max_model_len = min(self.max_model_len, config.max_model_len)
        runners = [r for r in (self.target, self.draft) if r is not None]
        # None = unbounded; a budget too small for a whole context lowers max_model_len.
        self.kv_budget, self.max_model_len = size_kv_budget(config, self.device, runners, self.max_model_len)
        self.tokenizer_id = tokenizer_id_for_path(config.target_dir)
        self.eos_token_ids = eos_token_ids(config.target_dir, self.tokenizer)
        self.masks: MaskChannel | None = None
        self.session_owner = _session_owner() if config.mask_service_addresses else ""
        if config.mask_service_addresses:
            self.masks = MaskChannel.connect(
                config.mask_service_addresses,
                tokenizer_id=self.tokenizer_id,
                vocab_size=self.vocab_size,
                deadline_s=config.mask_deadline_s,
                owner=self.session_owner,
                compile_wait_s=config.compile_wait_s,
            )
        self.sessions = MaskSessions(
            self.masks,
            open_timeout_s=max(config.compile_wait_s, config.mask_deadline_s * 4),
            wait_s=config.mask_deadline_s * 4,
        )
        # Mask rows resident on the device: one mirror for the draft-side masking and the verifier.
        self.mask_table = DeviceMaskTable(self.device)
        self.proposers = build_proposers(
            ProposerResources(
                vocab_size=self.vocab_size,
                draft_runner=self.draft,
                ngram_min=config.ngram_min,
                ngram_max=config.ngram_max,
                mask_table=self.mask_table,
            )
        )
        self.stepper = StepRunner(
            self.target,
            self.proposers,
            self.masks,
            max_model_len=self.max_model_len,
            draft_max_len=self.draft.max_model_len if self.draft is not None else None,
            mask_timeout_s=config.mask_deadline_s * 4,
            mask_table=self.mask_table,
        )
        self._seqs = SequenceTable(self.sessions)  # insertion order = batch order
        # The iteration's token budget and how new prompts are fed within it (gpu_worker.planning).
        self.planner = IterationPlanner.of(
            iteration_budget(config, self.device.type), config.step_prefill_tokens, self.target.cost
        )
        self.prompts = PromptReader(self.target, self.draft, self._seqs.fail)
        self.admission = Admission(
            WorkerLimits(
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                max_batch=config.max_batch,
                max_k=config.max_k,
                eos_token_ids=tuple(self.eos_token_ids),
                proposers=frozenset(self.proposers),
                draft_vocab_size=self.draft.input_vocab_size if self.draft is not None else None,
                has_mask_service=self.masks is not None,
            ),
            self.kv_budget,
            seed=config.seed,
        )
        # Steps finished; with the prompt reader's forwards, the heartbeat's progress (``progress``).
        self.progress_count = 0
        logger.info(
            "worker ready: target=%s draft=%s device=%s V=%d max_len=%d proposers=%s",
            config.target_dir,
            config.draft_dir,
            self.device,
            self.vocab_size,
            self.max_model_len,
            sorted(self.proposers),
        )
        if _session_owner():
            # A Ray actor process of its own: keep what loading left (torch, transformers, the
            # models' modules, the tokenizer: hundreds of thousands of objects) out of full
            # GC passes between steps, as the orchestrator and mask-service mains do. Not in a
            # process that merely builds a worker (tests, benches): it would freeze theirs.
            gc.collect()
            gc.freeze()

    def kv_usage(self) -> float | None:
        """The fraction of the KV budget the active sequences reserve; None without a budget."""
        if self.kv_budget is None:
            return None
        return self.kv_budget.usage([self.admission.need(s) for s in self._seqs.values()])

    # -- public API -----------------------------------------------------------
    def info(self) -> WorkerInfo:
        return WorkerInfo(
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            tokenizer_id=self.tokenizer_id,
            eos_token_ids=self.eos_token_ids,
            device=str(self.device),
            has_draft_model=self.draft is not None,
            max_k=self.config.max_k,
            pid=os.getpid(),
            session_owner=self.session_owner,
            torch_threads=torch.get_num_threads(),
            kv_budget=self.kv_budget,
        )

    def num_active(self) -> int:
        return len(self._seqs)

    def active_ids(self) -> list[str]:
        return list(self._seqs)

    def add(self, seqs: Sequence[NewSequence], *, wait_for_sessions: bool = False) -> list[str | None]:
        """Validate and start opening mask sessions. Returns per sequence None or an error
        message. A session open that fails is reported by the sequence's next step (an ERROR
        output, whose ``error_kind`` says whether the tier was away or the grammar refused), not
        by add(), whose answers carry no kind. add() runs no forward: long
        prompts are prefilled in chunks by the following iterations, within their token budget
        (``step``), so an add() of any size returns at once.

        ``wait_for_sessions`` waits for every answer, so add() reports them all itself, and prefills
        every prompt now, so the first steps' batches depend neither on how fast the opens
        answer nor on the iteration budget (benchmarks, whose timed steps must be decode steps;
        seeded replays)."""
        errors, accepted = self.admission.admit_batch(seqs, self._seqs)
        # Opens are not waited for here (gpu_worker.sessions says why); a sequence whose
        # session is still opening when a step starts sits it out (``SequenceTable.settle_sessions``).
        for _, state in accepted:
            self.sessions.open(state)
        self.prompts.reserve([s for _, s in accepted])
        for _, state in accepted:
            # Cached by the iterations' prefill chunks (``_plan_chunks``), within their budget;
            # the first step feeds the tail (WorkerConfig.step_prefill_tokens, planning.tail_tokens).
            state.prefill_to = len(state.token_ids) - self.planner.tail_tokens(len(state.token_ids))
        if wait_for_sessions:
            try:
                self.prompts.read_whole([s for _, s in accepted])
            except Exception as exc:
                logger.exception("prefill of %d sequences failed", len(accepted))
                for i, state in accepted:
                    errors[i] = f"prefill failed: {exc}"
                    free(state, self.sessions)
                return errors
            self.sessions.wait_all([s for _, s in accepted])
        for i, state in accepted:
            # Waited for: every open has answered, and a refusal is add()'s answer. Else the
            # sequence's first step settles it (``settle_sessions``), a failure then a typed output.
            failure = self.sessions.settle(state) if wait_for_sessions else None
            if failure is not None:
                errors[i] = failure.message
                free(state, self.sessions)
                continue
            self._seqs.hold(state)
            logger.info(
                "[request_id=%s] seq %s added: prompt=%d grammar=%s mask_session=%s k=%d proposers=%s",
                state.request_id,
                state.seq_id,
                state.prompt_len,
                state.has_grammar,
                "opening" if state.session_opening is not None else state.session_id,
                state.k,
                state.proposers,
            )
        return errors

    def step(self) -> list[StepOutput]:
        """One iteration within the iteration budget (gpu_worker.token_cost: a token counts
        its attention over the keys before it), as gpu_worker.planning plans it: a decoding
        step for the sequences ``_step_batch`` picks (running ones first), with chunks of the
        prompts not yet cached riding in the step's target forward with what is left
        (``_plan_chunks``), so an iteration reads the weights once; finished sequences are
        freed. With nothing to step, the chunks run alone (``PromptReader.read``) within
        ``planning.IDLE_PREFILL_BUDGET``. A sequence
        whose session is still opening when the step starts joins it late if the open answers
        while the drafts are proposed (``join_late``) and its tail fits; otherwise it sits this
        step out (no output for it).
        If nobody could step and no prompt is being prefilled, the step waits for an open to
        answer."""
        refused = self._seqs.settle_sessions(wait=False)
        prefilling = any(s.prefilling for s in self._seqs.values())
        batch = self._step_batch(prefilling)
        if not batch and self._seqs and not prefilling:
            refused += self._seqs.settle_sessions(wait=True)
            batch = self._step_batch(prefilling)
        if not batch:
            return refused + self.prompts.read(self._plan_chunks(self.planner.idle_budget()))
        return refused + self._step(batch, refused, self.planner.step_budget(prefilling))

    def _step_batch(self, prefilling: bool) -> list[SequenceState]:
        """The sequences this iteration's step takes (planning.IterationPlanner.step_batch)."""
        return [self._seqs[seq_id] for seq_id in self.planner.step_batch(self._seqs.views(), prefilling)]

    def _step(self, batch: list[SequenceState], refused: list[StepOutput], budget: int) -> list[StepOutput]:
        """One decoding step of ``batch`` within ``budget`` (late joiners included), with
        prompt chunks riding in its target forward within what is left of the iteration's."""
        joined: list[SequenceState] = []
        in_batch = {s.seq_id for s in batch}
        room = self.planner.step_room([(plan_view(s), self.stepper.plan_k(s)) for s in batch], budget)

        def join_late() -> list[SequenceState]:
            # A new grammar sequence would otherwise sit its first step out: the step after its
            # add() begins a Ray call later, before the open's round trip to the mask service has
            # answered (milliseconds into its open). The proposal phase (draft forwards, draft-mask
            # round trips) gives the open that time; joining then saves the sequence an iteration.
            nonlocal room
            refused.extend(self._seqs.settle_sessions(wait=False))
            late, room = self.planner.late_joiners(self._seqs.views(), in_batch, room)
            joined.extend(self._seqs[seq_id] for seq_id in late)
            return joined

        riders = ChunkRiders(self.planner, self._plan_chunks)
        try:
            outputs = self.stepper.run(batch, joiners=join_late, token_budget=budget, riders=riders)
        except Exception as exc:
            logger.exception("step failed for %d sequences", len(batch) + len(joined) + len(riders.chunks))
            outputs = [
                StepOutput(s.seq_id, [], FinishReason.ERROR, error=f"step failed: {exc}") for s in batch + joined
            ]
            outputs += self._seqs.fail([s for s, _ in riders.chunks], f"step failed: {exc}")
            riders.chunks = []
        read_alone: list[StepOutput] = []
        if riders.error is not None:
            read_alone = self.prompts.read_alone(riders.chunks)
            riders.chunks = []
        note_session_waits(self._seqs, in_batch, joined, outputs)
        for out in outputs:
            if out.finish_reason is not None and out.seq_id in self._seqs:
                state = self._seqs.retire(out.seq_id, out.finish_reason)
                logger.info(
                    "[request_id=%s] seq %s finished: %s after %d output tokens%s",
                    state.request_id,
                    out.seq_id,
                    out.finish_reason.name,
                    state.num_output,
                    f" ({out.error})" if out.error else "",
                )
        self.progress_count += 1
        return outputs + read_alone + self.prompts.catch_up_drafts([s for s, _ in riders.chunks])

    def iterate(
        self,
        removes: Sequence[str] = (),
        adds: Sequence[NewSequence] = (),
        trace: Mapping[str, Carrier] | None = None,
    ) -> Iteration:
        """``remove(removes)``, ``add(adds)``, then ``step()``: one Ray call for what the
        orchestrator's step loop does each iteration (each call costs both processes CPU on
        the step's path; three a step under a flood of short requests). Removes go first: the
        slots they free may be the ones the adds take. Ids this worker does not hold are
        reported, not raised.

        ``trace``: request id -> the orchestrator's iteration span of each traced request of
        the batch, as W3C headers (absent while tracing is off). This iteration's span
        continues the first and links the others (one call serves them all); the mask-service
        calls it makes carry it (gpu_worker.masks binds their threads to it)."""
        span = NO_SPAN
        if trace:
            span = tracing.start_batch_span(
                WORKER_ITERATION_SPAN,
                list(trace.values()),
                {"specmask.worker.adds": len(adds), "specmask.worker.removes": len(removes)},
            )
        with tracing.scope(span):
            unknown = self._seqs.cancel(removes)
            add_errors = self.add(adds) if adds else []
            outputs = self.step() if self._seqs else []
            span.set_attributes({"specmask.worker.stepped": len(outputs), "specmask.worker.active": len(self._seqs)})
        return Iteration(add_errors, outputs, unknown)

    def remove(self, seq_ids: Sequence[str]) -> None:
        """Cancel sequences: free KV caches, close mask sessions."""
        unknown = self._seqs.cancel(seq_ids)
        if unknown:
            raise UnknownSequenceError(f"unknown sequence id(s): {unknown}")

    def reset(self) -> int:
        """Free every sequence (KV caches, mask sessions); returns how many there were.

        For a caller that lost track of this worker (a step timed out): whatever it
        still holds belongs to requests that have already been failed."""
        freed = self._seqs.cancel_all()
        if freed:
            logger.warning("reset: freed %d sequences", freed)
        return freed

    def shutdown(self) -> None:
        """Free everything and close the mask-service connection."""
        self._seqs.cancel_all()
        if self.masks is not None:
            self.masks.close()

    def _plan_chunks(self, budget: float) -> list[tuple[SequenceState, list[int]]]:
        """The next prompt chunks to cache within ``budget`` budget tokens, each with its
        sequence (planning.IterationPlanner.plan_chunks)."""
        chunks = []
        for c in self.planner.plan_chunks(self._seqs.views(), budget):
            s = self._seqs[c.seq_id]
            chunks.append((s, s.token_ids[c.start : c.start + c.count]))
        return chunks

    def progress(self) -> WorkerProgress:
        """The heartbeat: how many forwards and steps this worker has finished. Answered on its
        own thread (the ``liveness`` concurrency group, ``start_remote_worker``), so it answers
        while an iteration runs; the orchestrator reads a count that moves as a worker that
        is slow, not stuck."""
        return WorkerProgress(count=self.progress_count + self.prompts.forwards, active=len(self._seqs))


def _session_owner() -> str:
    """The Ray actor id, which a restarted actor keeps: its sessions name it, so a restart
    releases what the crashed process left open. Outside an actor: no owner. Tagged with a
    secret (mask_service.auth.owner_tag): the actor id alone, which Ray's logs show, does
    not release this worker's sessions."""
    try:
        import ray

        if ray.is_initialized():
            actor_id = ray.get_runtime_context().get_actor_id()
            if actor_id:
                return owner_tag(f"gpu-worker-{actor_id}")
    except Exception as exc:  # an owner is an optimisation; never fail start-up over it
        logger.warning("no session owner (ray runtime context unavailable: %s)", exc)
    return ""


def start_remote_worker(config: WorkerConfig, *, num_gpus: float | None = None, **ray_options: Any) -> Any:
    """Start ``GpuWorker`` as a Ray actor; returns the actor handle.

    ``num_gpus=None`` asks for one GPU when the Ray cluster has any, else none
    (the CPU fallback). An actor asking for a GPU that no node has pends forever,
    so callers should always put timeouts on ``ray.get``.
    """
    import ray

    if num_gpus is None:
        num_gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    ray_options.setdefault("concurrency_groups", {LIVENESS_GROUP: 1})
    return ray.remote(num_gpus=num_gpus, **ray_options)(GpuWorker).remote(config)
