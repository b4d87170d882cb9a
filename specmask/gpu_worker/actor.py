"""``GpuWorker``: owns the target and draft models, the sequences, and the step loop.

A plain class, so tests can use it in-process; ``ray.remote(GpuWorker)`` (or
``start_remote_worker``) makes it the per-GPU Ray actor. Ray runs an actor's
methods one at a time, so no locking is needed around sequence state.

Errors: a bad sequence never takes the worker down. ``add`` returns an error
message per refused sequence; ``step`` reports a failed sequence as
``FinishReason.ERROR`` with ``StepOutput.error`` and frees it; ``remove`` of an
unknown id raises ``UnknownSequenceError`` after removing the known ones.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import random
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait
from typing import Any

import torch

from specmask.common import tracing
from specmask.common.proposer_kind import ProposerKind
from specmask.common.tracing import NO_SPAN, Carrier
from specmask.gpu_worker.config import WorkerConfig, iteration_budget
from specmask.gpu_worker.kv_budget import KVBudget, budget_bytes, longest_sequence
from specmask.gpu_worker.kv_cache import MIN_CAPACITY, SequenceKV
from specmask.gpu_worker.loading import (
    checkpoint_dtype,
    cpu_threads,
    eos_token_ids,
    has_tokenizer,
    load_causal_lm,
    load_tokenizer,
    read_draft_vocab,
    resolve_device,
    resolve_dtype,
    restrict_output_vocab,
)
from specmask.gpu_worker.mask_errors import MASK_TIER_UNAVAILABLE, describe_mask_failure, failure_kind
from specmask.gpu_worker.mask_table import DeviceMaskTable
from specmask.gpu_worker.masks import MaskChannel, OpenedSession
from specmask.gpu_worker.model_runner import ForwardItem, ModelRunner
from specmask.gpu_worker.planning import IterationPlanner, PlanSeq, whole_chunk
from specmask.gpu_worker.proposers.base import ProposerResources
from specmask.gpu_worker.proposers.registry import build_proposers, order_names
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.static_forward import BATCH_BUCKETS, WIDTH_BUCKETS
from specmask.gpu_worker.step import StepRunner
from specmask.gpu_worker.types import (
    LIVENESS_GROUP,
    MAX_TOP_LOGPROBS,
    FinishReason,
    Iteration,
    NewSequence,
    SessionWait,
    StepOutput,
    UnknownSequenceError,
    WorkerInfo,
    WorkerProgress,
)
from specmask.mask_service.auth import owner_tag

logger = logging.getLogger(__name__)

_SEED_BITS = 63  # kernels take int64 seeds; keep them non-negative
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
        dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype(config.target_dir))
        self.tokenizer = load_tokenizer(config.target_dir)
        if target_model is None:
            target_model = load_causal_lm(
                config.target_dir, dtype, self.device, max_model_len=config.max_model_len, name="target"
            )
        threads = cpu_threads(config.torch_threads, self.device, sum(p.numel() for p in target_model.parameters()))
        if threads is not None:
            torch.set_num_threads(threads)
        self.target = ModelRunner(
            target_model,
            batched=config.batched_forward,
            name="target",
            static=config.static_forward,
            max_model_len=config.max_model_len,
        )
        self.draft: ModelRunner | None = None
        if config.draft_dir is not None:
            self._check_shared_tokenizer(config.draft_dir)
            draft_ids = read_draft_vocab(config.draft_dir, self.target.vocab_size)
            if draft_model is None:
                draft_model = load_causal_lm(
                    config.draft_dir, dtype, self.device, max_model_len=self.target.max_model_len, name="draft"
                )
                if draft_ids is not None:
                    restrict_output_vocab(draft_model, draft_ids)
            elif draft_ids is not None and draft_model.get_output_embeddings().weight.shape[0] != len(draft_ids):
                # A shared draft is another worker's, its head restricted when that worker loaded it.
                raise ValueError(
                    f"the shared draft model's head does not score the {len(draft_ids)} draft-vocabulary ids"
                )
            self.draft = ModelRunner(
                draft_model,
                batched=config.batched_forward,
                name="draft",
                static=config.static_forward,
                output_ids=draft_ids,
                max_model_len=self.target.max_model_len,  # a draft never runs past the target
            )
        self.vocab_size = self.target.vocab_size  # V: logits width
        self.max_model_len = self.target.max_model_len
        if config.max_model_len is not None:
            self.max_model_len = min(self.max_model_len, config.max_model_len)
        self.kv_budget = self._size_kv_budget()  # None = unbounded; may lower max_model_len
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
        # A session open waits for its grammar's compile (the replica answers when it is
        # ready): a sequence still opening is failed only past this, not past a mask call's
        # deadline, so a slow compile on a busy box is waited for, not refused.
        self._open_timeout_s = max(config.compile_wait_s, config.mask_deadline_s * 4)
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
        self._seqs: dict[str, SequenceState] = {}  # insertion order = batch order
        # The iteration's token budget and how new prompts are fed within it (gpu_worker.planning).
        self.planner = IterationPlanner.of(
            iteration_budget(config, self.device.type), config.step_prefill_tokens, self.target.cost
        )
        # Forwards (prefill chunks) and steps finished: the heartbeat's progress (``progress``).
        self.progress_count = 0
        self._rng = random.Random(config.seed)
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

    def _size_kv_budget(self) -> KVBudget | None:
        """The KV budget from the config (gpu_worker.kv_budget), split between the target's and
        the draft's pools by their bytes per position. A budget too small for a max_model_len
        sequence alone lowers max_model_len to the longest that fits (with a warning), so a
        request that could never fit is refused by the context check."""
        total = free = 0
        if self.config.gpu_memory_utilization is not None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
        nbytes = budget_bytes(
            kv_cache_bytes=self.config.kv_cache_bytes,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            device_type=self.device.type,
            total_bytes=total,
            free_bytes=free,
        )
        if nbytes is None:
            return None
        runners = [r for r in (self.target, self.draft) if r is not None]
        per_position = sum(r.kv_bytes_per_token for r in runners)
        positions = nbytes // per_position
        # A static forward on a GPU pads its batch to a bucket of slots; every forward writes up
        # to a verify row's k + 1 positions, or a static width bucket's, past a row's length.
        padded = any(r.static is not None and r.static.pad_to_buckets for r in runners)
        buckets = BATCH_BUCKETS if padded else ()
        slack = max(self.config.max_k + 1, WIDTH_BUCKETS[-1])
        longest = longest_sequence(positions, slack=slack, min_capacity=MIN_CAPACITY, slot_buckets=buckets)
        if longest < 2:
            raise ValueError(
                f"a KV budget of {nbytes} bytes ({positions} positions of {per_position} bytes) holds no "
                f"sequence: one needs at least {max(MIN_CAPACITY, 2 + slack)} positions"
            )
        if longest < self.max_model_len:
            logger.warning(
                "the KV budget (%d bytes, %d positions) holds one sequence of at most %d tokens: "
                "max_model_len lowered from %d",
                nbytes,
                positions,
                longest,
                self.max_model_len,
            )
            self.max_model_len = longest
        for runner in runners:
            runner.kv_budget_bytes = positions * runner.kv_bytes_per_token
        budget = KVBudget(positions, self.max_model_len, slack, MIN_CAPACITY, buckets)
        logger.info(
            "KV budget: %d bytes, %d slot-positions (%d bytes each, target and draft), e.g. %d sequences of %d",
            nbytes,
            positions,
            per_position,
            positions // budget.need(self.max_model_len, 0),
            self.max_model_len,
        )
        return budget

    def _need(self, s: SequenceState) -> int:
        """Positions per slot ``s`` reserves under the KV budget (kv_budget.KVBudget.need)."""
        assert self.kv_budget is not None
        return self.kv_budget.need(s.prompt_len, s.request.sampling.max_tokens)

    def kv_usage(self) -> float | None:
        """The fraction of the KV budget the active sequences reserve; None without a budget."""
        if self.kv_budget is None:
            return None
        return self.kv_budget.usage([self._need(s) for s in self._seqs.values()])

    def _check_shared_tokenizer(self, draft_dir: str) -> None:
        """Draft tokens are fed to the target as ids: both must use the same vocabulary."""
        if not has_tokenizer(draft_dir):
            return  # a draft dir without tokenizer files is taken to share the target's
        if load_tokenizer(draft_dir).get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"draft tokenizer in {draft_dir} differs from the target's")

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
        message. A session the mask service refuses is reported by add() if it had answered by
        then, else by the sequence's next step (an ERROR output). add() runs no forward: long
        prompts are prefilled in chunks by the following iterations, within their token budget
        (``step``), so an add() of any size returns at once.

        ``wait_for_sessions`` waits for every answer, so add() reports them all, and prefills
        every prompt now, so the first steps' batches depend neither on how fast the opens
        answer nor on the iteration budget (benchmarks, whose timed steps must be decode steps;
        seeded replays)."""
        errors: list[str | None] = [None] * len(seqs)
        accepted: list[tuple[int, SequenceState]] = []
        seen: set[str] = set()
        for i, req in enumerate(seqs):
            try:
                state = self._admit(req, seen, [s for _, s in accepted])
            except (ValueError, TypeError) as exc:
                errors[i] = str(exc)
                rid = getattr(req, "request_id", "") or getattr(req, "seq_id", "?")
                logger.warning("[request_id=%s] seq %s refused: %s", rid, getattr(req, "seq_id", "?"), exc)
                continue
            seen.add(req.seq_id)
            accepted.append((i, state))

        # Sessions open on the mask control threads (gpu_worker.masks), and add() does not
        # wait for them: a session is first needed by the sequence's first step, and add and
        # step share the actor's thread, so waiting here stalled every running sequence for a
        # round trip while a flood of new grammars kept the mask service busy. The orchestrator
        # sends add() as soon as it places a request, so the open runs while the orchestrator
        # handles the current step's outputs. A sequence whose
        # session is still opening when a step starts sits it out (``_settle_sessions``).
        for _, state in accepted:
            grammar = state.request.grammar
            if grammar is not None:
                assert self.masks is not None  # _admit refuses a grammar without a mask service
                state.session_opening = self.masks.open_session_async(grammar, request_id=state.request_id)
                state.opening_since = time.monotonic()
        if accepted:
            # Room for the new prompts and their first tokens (up to 64, drafts included) in one
            # resize of each pool, not one per chunk that passes the capacity while the running
            # sequences wait on each.
            longest = max(len(s.token_ids) + min(s.request.sampling.max_tokens, 64) + s.k + 1 for _, s in accepted)
            for runner in (self.target, self.draft):
                if runner is None:
                    continue
                try:
                    runner.reserve(len(accepted), longest)
                except Exception:  # e.g. out of memory: the forwards grow what they need, or fail alone
                    logger.warning("could not grow the %s KV pool for %d sequences", runner.name, len(accepted))
        for _, state in accepted:
            # Cached by the iterations' prefill chunks (``_plan_chunks``), within their budget;
            # the first step feeds the tail (WorkerConfig.step_prefill_tokens, planning.tail_tokens).
            state.prefill_to = len(state.token_ids) - self.planner.tail_tokens(len(state.token_ids))
        if wait_for_sessions:
            try:
                self._prefill([s for _, s in accepted])
            except Exception as exc:
                logger.exception("prefill of %d sequences failed", len(accepted))
                for i, state in accepted:
                    errors[i] = f"prefill failed: {exc}"
                    self._free(state)
                return errors
            opening = [s.session_opening for _, s in accepted if s.session_opening is not None]
            futures_wait(opening, timeout=self._open_timeout_s)
        for i, state in accepted:
            # Settled now if the open already answered (e.g. during a long prefill): a refusal
            # is then add()'s answer; later, it is the sequence's step output.
            failure = self._settle_session(state)
            if failure is not None:
                errors[i] = failure
                self._free(state)
                continue
            self._seqs[state.seq_id] = state
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
        freed. With nothing to step, the chunks run alone (``_prefill_some``) within
        ``planning.IDLE_PREFILL_BUDGET``. A sequence
        whose session is still opening when the step starts joins it late if the open answers
        while the drafts are proposed (``join_late``) and its tail fits; otherwise it sits this
        step out (no output for it).
        If nobody could step and no prompt is being prefilled, the step waits for an open to
        answer."""
        refused = self._settle_sessions(wait=False)
        prefilling = any(s.prefilling for s in self._seqs.values())
        batch = self._step_batch(prefilling)
        if not batch and self._seqs and not prefilling:
            refused += self._settle_sessions(wait=True)
            batch = self._step_batch(prefilling)
        if not batch:
            return refused + self._prefill_some(self.planner.idle_budget())
        return refused + self._step(batch, refused, self.planner.step_budget(prefilling))

    def _step_batch(self, prefilling: bool) -> list[SequenceState]:
        """The sequences this iteration's step takes (planning.IterationPlanner.step_batch)."""
        return [self._seqs[seq_id] for seq_id in self.planner.step_batch(self._views(), prefilling)]

    def _views(self) -> list[PlanSeq]:
        """The active sequences as the scheduler sees them, in arrival order."""
        return [plan_view(s) for s in self._seqs.values()]

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
            refused.extend(self._settle_sessions(wait=False))
            late, room = self.planner.late_joiners(self._views(), in_batch, room)
            joined.extend(self._seqs[seq_id] for seq_id in late)
            return joined

        riders = _ChunkRiders(self)
        try:
            outputs = self.stepper.run(batch, joiners=join_late, token_budget=budget, riders=riders)
        except Exception as exc:
            logger.exception("step failed for %d sequences", len(batch) + len(joined) + len(riders.chunks))
            outputs = [
                StepOutput(s.seq_id, [], FinishReason.ERROR, error=f"step failed: {exc}") for s in batch + joined
            ]
            outputs += self._fail_prefill([s for s, _ in riders.chunks], f"step failed: {exc}")
            riders.chunks = []
        read_alone: list[StepOutput] = []
        if riders.error is not None:
            read_alone = self._read_alone(riders.chunks)
            riders.chunks = []
        self._note_session_waits(in_batch, joined, outputs)
        for out in outputs:
            if out.finish_reason is not None and out.seq_id in self._seqs:
                state = self._seqs.pop(out.seq_id)
                state.finished = out.finish_reason
                self._free(state)
                logger.info(
                    "[request_id=%s] seq %s finished: %s after %d output tokens%s",
                    state.request_id,
                    out.seq_id,
                    out.finish_reason.name,
                    state.num_output,
                    f" ({out.error})" if out.error else "",
                )
        self.progress_count += 1
        return outputs + read_alone + self._catch_up_drafts([s for s, _ in riders.chunks])

    def _note_session_waits(self, in_batch: set[str], joined: list[SequenceState], outputs: list[StepOutput]) -> None:
        """Count this step against the sequences still waiting for their sessions, and put
        how each grammar sequence's wait ended on its first output (``SessionWait``)."""
        joined_ids = {s.seq_id for s in joined}
        for waiting in self._seqs.values():
            if waiting.seq_id in joined_ids:
                waiting.joined_late = True
            elif waiting.seq_id not in in_batch:
                waiting.steps_sat_out += 1  # still opening (or opened after the join point)
        for out in outputs:
            state = self._seqs.get(out.seq_id)
            if state is None or not state.has_grammar or state.session_wait_reported:
                continue
            state.session_wait_reported = True
            out.steps_sat_out = state.steps_sat_out
            if state.joined_late:
                out.session_wait = SessionWait.JOINED_LATE
            else:
                out.session_wait = SessionWait.SAT_OUT if state.steps_sat_out else SessionWait.READY

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
            unknown = self._remove(removes)
            add_errors = self.add(adds) if adds else []
            outputs = self.step() if self._seqs else []
            span.set_attributes({"specmask.worker.stepped": len(outputs), "specmask.worker.active": len(self._seqs)})
        return Iteration(add_errors, outputs, unknown)

    def remove(self, seq_ids: Sequence[str]) -> None:
        """Cancel sequences: free KV caches, close mask sessions."""
        unknown = self._remove(seq_ids)
        if unknown:
            raise UnknownSequenceError(f"unknown sequence id(s): {unknown}")

    def _remove(self, seq_ids: Sequence[str]) -> list[str]:
        """Cancel the sequences this worker holds; returns the ids it does not."""
        unknown = []
        for seq_id in seq_ids:
            state = self._seqs.pop(seq_id, None)
            if state is None:
                unknown.append(seq_id)
                continue
            state.finished = FinishReason.CANCELLED
            self._free(state)
            logger.info(
                "[request_id=%s] seq %s cancelled after %d output tokens", state.request_id, seq_id, state.num_output
            )
        return unknown

    def reset(self) -> int:
        """Free every sequence (KV caches, mask sessions); returns how many there were.

        For a caller that lost track of this worker (a step timed out): whatever it
        still holds belongs to requests that have already been failed."""
        states = list(self._seqs.values())
        self._seqs.clear()
        for state in states:
            state.finished = FinishReason.CANCELLED
            self._free(state)
        if states:
            logger.warning("reset: freed %d sequences", len(states))
        return len(states)

    def shutdown(self) -> None:
        """Free everything and close the mask-service connection."""
        for state in list(self._seqs.values()):
            self._free(state)
        self._seqs.clear()
        if self.masks is not None:
            self.masks.close()

    # -- internals --------------------------------------------------------------
    def _admit(self, req: Any, seen: set[str], accepted: Sequence[SequenceState]) -> SequenceState:
        """Check one request and build its state (raises ValueError/TypeError with a clear message);
        ``accepted``: the ones this add() has admitted before it."""
        if not isinstance(req, NewSequence):
            raise TypeError(f"expected NewSequence, got {type(req).__name__}")
        if not isinstance(req.seq_id, str) or not req.seq_id:
            raise ValueError("seq_id must be a non-empty string")
        if req.seq_id in self._seqs or req.seq_id in seen:
            raise ValueError(f"duplicate seq_id {req.seq_id!r}")
        if len(self._seqs) + len(accepted) >= self.config.max_batch:
            raise ValueError(f"worker is full ({self.config.max_batch} active sequences)")
        prompt = list(req.prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        self._check_ids(prompt, "prompt")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room below max_model_len {self.max_model_len}")
        p = req.sampling
        if not (math.isfinite(p.temperature) and p.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
        if p.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {p.top_k}")
        if p.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
        if p.logprobs is not None and not 0 <= p.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.logprobs}")
        spec = req.speculation
        if not 0 <= spec.k <= self.config.max_k:
            raise ValueError(f"speculation k must be in [0, {self.config.max_k}], got {spec.k}")
        proposers: tuple[str, ...] = ()
        if spec.enabled and spec.k > 0:
            proposers = tuple(n for n in order_names(spec.proposers) if n in self.proposers)
        if req.grammar is not None and self.masks is None:
            raise ValueError("sequence has a grammar but the worker has no mask service configured")
        stop_ids = self.eos_token_ids if req.stop_token_ids is None else tuple(req.stop_token_ids)
        self._check_ids(stop_ids, "stop")
        if ProposerKind.DRAFT_MODEL in proposers:
            assert self.draft is not None
            if max(prompt) >= self.draft.input_vocab_size:
                raise ValueError(f"prompt token id {max(prompt)} is outside the draft vocabulary")
        if self.kv_budget is not None:
            # The orchestrator places a request only where it fits (engine._place); this is the
            # worker's own guard, so a pool never has to grow past its budget mid-step.
            needs = [self._need(s) for s in (*self._seqs.values(), *accepted)]
            needs.append(self.kv_budget.need(len(prompt), p.max_tokens))
            if not self.kv_budget.fits(needs):
                raise ValueError(
                    f"KV budget full: {len(needs)} sequences would reserve {self.kv_budget.reserved(needs)} of its "
                    f"{self.kv_budget.positions} slot-positions; retry when running ones finish"
                )
        seed = p.seed if p.seed is not None else self._rng.getrandbits(_SEED_BITS)
        return SequenceState(
            request=req,
            stop_token_ids=frozenset(stop_ids),
            proposers=proposers,
            k=spec.k if proposers else 0,
            seed=seed & ((1 << _SEED_BITS) - 1),
            token_ids=prompt,
            draft_kv=SequenceKV() if ProposerKind.DRAFT_MODEL in proposers else None,
        )

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"{what} token id {t!r} outside [0, {self.vocab_size})")

    def _prefill(self, states: Sequence[SequenceState]) -> None:
        """Cache each prompt up to its tail now, sequence by sequence, a whole chunk at a
        time (planning.whole_chunk) (``add(wait_for_sessions=True)``: benchmarks and replays; serving prefills within
        the iterations' budget instead, ``_plan_chunks``)."""
        for s in states:
            while s.prefilling:
                c = whole_chunk(plan_view(s))
                chunk = s.token_ids[c.start : c.start + c.count]
                self.target.forward([ForwardItem(s.target_kv, chunk, 0)])
                self._forward_drafts([s])
                self.progress_count += 1

    def _plan_chunks(self, budget: float) -> list[tuple[SequenceState, list[int]]]:
        """The next prompt chunks to cache within ``budget`` budget tokens, each with its
        sequence (planning.IterationPlanner.plan_chunks)."""
        chunks = []
        for c in self.planner.plan_chunks(self._views(), budget):
            s = self._seqs[c.seq_id]
            chunks.append((s, s.token_ids[c.start : c.start + c.count]))
        return chunks

    def _prefill_some(self, budget: int) -> list[StepOutput]:
        """An iteration with nothing to step: the chunks ``_plan_chunks`` picks, in one target
        forward. If that forward fails, each chunk is retried in a forward of its own, so a
        sequence whose prefill fails is freed and reported as an ERROR output alone."""
        chunks = self._plan_chunks(budget)
        if not chunks:
            return []
        try:
            self.target.forward([ForwardItem(s.target_kv, chunk, 0) for s, chunk in chunks])
        except Exception as exc:
            if len(chunks) == 1:
                return self._fail_prefill([chunks[0][0]], f"prefill failed: {exc}", log=True)
            logger.warning("a prefill forward of %d chunks failed (%s); retrying them one by one", len(chunks), exc)
            self.progress_count += 1
            return self._read_alone(chunks)
        self.progress_count += 1
        return self._catch_up_drafts([s for s, _ in chunks])

    def _read_alone(self, chunks: Sequence[tuple[SequenceState, list[int]]]) -> list[StepOutput]:
        """Each chunk in a target forward of its own (after a forward with them all failed): a
        sequence whose chunk fails again is freed and reported; the rest are read."""
        failed: list[StepOutput] = []
        for s, chunk in chunks:
            try:
                self.target.forward([ForwardItem(s.target_kv, chunk, 0)])
            except Exception as one:
                failed += self._fail_prefill([s], f"prefill failed: {one}", log=True)
        return failed + self._catch_up_drafts([s for s, _ in chunks if s.seq_id in self._seqs])

    def _catch_up_drafts(self, states: Sequence[SequenceState]) -> list[StepOutput]:
        """Bring the draft model's caches of ``states`` level with the target's (after their
        prompt chunks); a sequence whose draft forward fails is freed and reported."""
        try:
            self._forward_drafts(states)
        except Exception:
            logger.warning("a draft prefill forward of %d sequences failed; retrying them one by one", len(states))
            failed: list[StepOutput] = []
            for s in states:
                try:
                    self._forward_drafts([s])
                except Exception as exc:
                    failed += self._fail_prefill([s], f"draft prefill failed: {exc}", log=True)
            return failed
        return []

    def _forward_drafts(self, states: Sequence[SequenceState]) -> None:
        """One draft forward feeding each of ``states`` the prompt tokens its target has cached
        and its draft has not: the draft keeps pace with the target's prefill."""
        items = [
            ForwardItem(s.draft_kv, s.token_ids[s.draft_kv.length : s.target_kv.length], 0)
            for s in states
            if s.draft_kv is not None and s.draft_kv.length < s.target_kv.length
        ]
        if items:
            assert self.draft is not None
            self.draft.forward(items)

    def _fail_prefill(self, states: Sequence[SequenceState], why: str, *, log: bool = False) -> list[StepOutput]:
        """Free ``states`` (sequences whose prompt could not be cached) and report each as ERROR."""
        failed = []
        for s in states:
            if log:
                logger.exception("[request_id=%s] seq %s: %s", s.request_id, s.seq_id, why)
            self._seqs.pop(s.seq_id, None)
            s.finished = FinishReason.ERROR
            self._free(s)
            failed.append(StepOutput(s.seq_id, [], FinishReason.ERROR, error=why))
        return failed

    def progress(self) -> WorkerProgress:
        """The heartbeat: how many forwards and steps this worker has finished. Answered on its
        own thread (the ``liveness`` concurrency group, ``start_remote_worker``), so it answers
        while an iteration runs; the orchestrator reads a count that moves as a worker that
        is slow, not stuck."""
        return WorkerProgress(count=self.progress_count, active=len(self._seqs))

    def _settle_session(self, state: SequenceState) -> str | None:
        """If ``state``'s session open has answered, take its session id, or return why it
        failed. Still opening past the mask timeout is a failure too (the router's own
        deadlines end a call well before). None: open, or still opening."""
        opening = state.session_opening
        if opening is None:
            return None
        if not opening.done():
            waited = time.monotonic() - state.opening_since
            if waited <= self._open_timeout_s:
                return None
            return f"{MASK_TIER_UNAVAILABLE}: opening the grammar session took over {waited:.0f} s; retry"
        state.session_opening = None
        try:
            opened = opening.result()
            state.session_id = opened.session_id
            # The grammar is over once any of its stop tokens is taken, and the service walks
            # no state past it (no row there is real): the sequence stops on each of them.
            state.stop_token_ids = state.stop_token_ids | opened.stop_token_ids
        except Exception as exc:
            logger.warning(
                "[request_id=%s] seq %s: opening mask session failed: %s", state.request_id, state.seq_id, exc
            )
            return describe_mask_failure(exc, "opening the grammar session")
        return None

    def _settle_sessions(self, *, wait: bool) -> list[StepOutput]:
        """Settle every opening session (``wait``: first block until one answers, up to the mask
        timeout); a sequence whose open failed is freed and reported as an ERROR output."""
        opening = [s for s in self._seqs.values() if s.session_opening is not None]
        if wait and opening:
            futures_wait(
                [s.session_opening for s in opening if s.session_opening is not None],
                timeout=self.stepper.mask_timeout_s,
                return_when=FIRST_COMPLETED,
            )
        failed = []
        for state in opening:
            failure = self._settle_session(state)
            if failure is not None:
                del self._seqs[state.seq_id]
                state.finished = FinishReason.ERROR
                self._free(state)
                kind = failure_kind(failure)
                failed.append(StepOutput(state.seq_id, [], FinishReason.ERROR, error=failure, error_kind=kind))
        return failed

    def _free(self, state: SequenceState) -> None:
        state.target_kv.free()
        if state.draft_kv is not None:
            state.draft_kv.free()
        if state.session_opening is not None:
            # Freed before its session opened: close it once it does, so none is left open.
            opening, state.session_opening = state.session_opening, None
            opening.add_done_callback(functools.partial(self._close_late, state.seq_id, state.request_id))
        if state.session_id is not None and self.masks is not None:
            self.masks.close_session_later(state.session_id, state.seq_id, request_id=state.request_id)
            state.session_id = None

    def _close_late(self, seq_id: str, request_id: str, opening: Future[OpenedSession]) -> None:
        if self.masks is None or opening.cancelled() or opening.exception() is not None:
            return
        try:
            self.masks.close_session_later(opening.result().session_id, seq_id, request_id=request_id)
        except RuntimeError as exc:  # the channel is closed (shutdown): the service's TTL reclaims it
            logger.warning("[request_id=%s] seq %s: mask session left to expire: %s", request_id, seq_id, exc)


class _ChunkRiders:
    """A step's prompt chunks (``GpuWorker._step``): planned with what the step's rows leave of
    the iteration's budget, fed in the step's target forward (step.Riders)."""

    def __init__(self, worker: GpuWorker) -> None:
        self.worker = worker
        self.chunks: list[tuple[SequenceState, list[int]]] = []  # what rode: each sequence's chunk
        self.error: Exception | None = None  # the forward with them failed (the step went on)

    def take(self, used: float) -> list[ForwardItem]:
        self.chunks = self.worker._plan_chunks(self.worker.planner.rider_budget(used))
        return [ForwardItem(s.target_kv, chunk, 0) for s, chunk in self.chunks]

    def failed(self, exc: Exception) -> None:
        n = len(self.chunks)
        logger.error(
            "a step's forward with %d prompt chunks failed (%s); the step went on, they are read alone", n, exc
        )
        self.error = exc


def plan_view(s: SequenceState) -> PlanSeq:
    """``s`` as the scheduler sees it (gpu_worker.planning)."""
    return PlanSeq(s.seq_id, s.target_kv.length, len(s.token_ids), s.prefill_to, s.session_opening is None)


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
