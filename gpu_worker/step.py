"""One decoding step for a batch of sequences (DESIGN.md "One decoding step").

    plan k_r -> propose d_1..d_k (position by position) -> send verify masks
    (async, carrying the previous step's commit) -> target forward over
    [uncached committed tokens, d_1..d_k] -> wait for masks -> mask + rejection
    sample -> commit: append tokens, crop KV caches, finish.

Mask-service traffic per step: with draft-side masking or grammar-forced drafts,
one batched request per draft position during proposal (the grammar state after
d_1..d_{i-1} is needed before d_i exists), plus exactly one on the verify path,
which is in flight while the target forward runs. Every request of the step
carries the same (commit_tokens, commit_seq); the first applies it, the rest are
no-ops, so there is no separate commit round trip.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from gpu_worker.bitmask_rows import is_allowed
from gpu_worker.masks import MaskChannel
from gpu_worker.model_runner import ForwardItem, ModelRunner
from gpu_worker.proposers.base import DraftSlot, Proposer
from gpu_worker.sequence import SequenceState
from gpu_worker.types import FinishReason, StepOutput
from gpu_worker.verifier import VerifyInput, verify

logger = logging.getLogger(__name__)

# Seconds to wait for a mask-service answer beyond the router's own deadline
# and retries, before the step gives up on the grammar sequences of the batch.
_MASK_WAIT_SLACK_S = 5.0


@dataclass
class _MaskReply:
    results: dict[str, Any]  # seq_id -> mask_service.client.DraftMaskResult
    errors: dict[str, str]  # seq_id -> message
    wait_s: float  # time the step thread was blocked on it


class StepRunner:
    """Runs steps; owns no sequences (the actor does)."""

    def __init__(
        self,
        target: ModelRunner,
        proposers: dict[str, Proposer],
        masks: MaskChannel | None,
        *,
        max_model_len: int,
        draft_max_len: int | None,
        mask_timeout_s: float,
        kernel_backend: Any = None,
    ) -> None:
        self.target = target
        self.proposers = proposers  # name -> instance, for the proposers this worker can run
        self._ordered = sorted(proposers.values(), key=lambda p: (p.priority, p.name))
        self.masks = masks
        self.max_model_len = max_model_len
        self.draft_max_len = draft_max_len
        self.mask_timeout_s = mask_timeout_s + _MASK_WAIT_SLACK_S
        self.kernel_backend = kernel_backend

    # -- planning -----------------------------------------------------------
    def plan_k(self, seq: SequenceState) -> int:
        """k_r for this step: 0 when speculation is off, or when x + K would pass a
        model's maximum length (the sequence then decodes plainly in the same batch).
        Also capped at the remaining output budget minus one: drafts past max_tokens
        would be truncated anyway (exactness is unaffected by any k_r)."""
        if seq.k == 0 or not seq.proposers:
            return 0
        limit = self.max_model_len
        if "draft_model" in seq.proposers and self.draft_max_len is not None:
            limit = min(limit, self.draft_max_len)
        if len(seq.token_ids) + seq.k > limit:
            return 0
        remaining = seq.request.sampling.max_tokens - seq.num_output
        return max(0, min(seq.k, remaining - 1))

    def _wants_masks(self, seq: SequenceState) -> bool:
        """Whether proposal for ``seq`` needs the grammar mask at each draft position."""
        if not seq.has_grammar or self.masks is None:
            return False
        if seq.request.speculation.draft_masking and "draft_model" in seq.proposers:
            return True
        return any(self.proposers[n].needs_masks for n in seq.proposers if n in self.proposers)

    # -- mask-service calls ---------------------------------------------------
    def _mask_items(self, slots: Sequence[DraftSlot], *, last_row_only: bool) -> list[Any]:
        from mask_service.client import DraftMaskItem

        items = []
        for s in slots:
            commit_tokens, commit_seq = s.seq.next_commit()
            items.append(
                DraftMaskItem(
                    session_id=s.seq.session_id,
                    draft_tokens=list(s.drafts),
                    commit_tokens=commit_tokens,
                    commit_seq=commit_seq,
                    last_row_only=last_row_only,
                )
            )
        return items

    def _collect(self, future: Any, slots: Sequence[DraftSlot], items: list[Any]) -> _MaskReply:
        """Wait for a batched mask call; on a per-item error fail only that sequence.

        The service fails a batch call for its first failed item and names it
        (``MaskServiceError.session_id``, the router's id = ``seq.session_id``), so
        that sequence gets the error and the batch is resent without it. The other
        items' commits may already be applied; resending them is safe because
        commits are idempotent by commit_seq and masks never change committed
        state. An error that names no item of the batch (replicas unreachable,
        timeout, batch-level refusal) fails every sequence still in the batch.
        """
        assert self.masks is not None
        t0 = time.perf_counter()
        reply = _MaskReply({}, {}, 0.0)
        remaining = {s.seq.session_id: (s.seq.seq_id, item) for s, item in zip(slots, items)}
        while remaining:
            try:
                results, _ = future.result(timeout=self.mask_timeout_s)
                if len(results) != len(remaining):
                    raise RuntimeError(f"mask service returned {len(results)} results for {len(remaining)} items")
                reply.results.update((seq_id, res) for (seq_id, _), res in zip(remaining.values(), results))
                break
            except FutureTimeout:
                msg = f"mask service did not answer within {self.mask_timeout_s:.1f}s"
                reply.errors.update((seq_id, msg) for seq_id, _ in remaining.values())
                break
            except Exception as exc:  # noqa: BLE001 - attributed to one sequence or to all below
                failed = remaining.pop(getattr(exc, "session_id", None) or "", None)
                if failed is None:
                    reply.errors.update((seq_id, f"mask service: {exc}") for seq_id, _ in remaining.values())
                    break
                reply.errors[failed[0]] = f"mask service: {exc}"
                logger.warning("mask call failed for seq %s (%s); resending the other %d", failed[0], exc, len(remaining))
                if remaining:
                    future = self.masks.draft_masks_async([item for _, item in remaining.values()])
        reply.wait_s = time.perf_counter() - t0
        return reply

    # -- proposal -------------------------------------------------------------
    def propose(self, slots: list[DraftSlot], errors: dict[str, str]) -> float:
        """Fill slot.drafts position by position; returns seconds spent waiting on masks."""
        waited = 0.0
        max_k = max((s.k for s in slots), default=0)
        for position in range(1, max_k + 1):
            open_slots = [s for s in slots if s.open and len(s.drafts) < s.k and s.seq.seq_id not in errors]
            if not open_slots:
                break
            masked = [s for s in open_slots if self._wants_masks(s.seq)]
            if masked:
                assert self.masks is not None
                items = self._mask_items(masked, last_row_only=True)
                reply = self._collect(self.masks.draft_masks_async(items), masked, items)
                waited += reply.wait_s
                errors.update(reply.errors)
                for s in masked:
                    res = reply.results.get(s.seq.seq_id)
                    if res is None or res.terminated or res.num_grammar_accepted < len(s.drafts):
                        # Terminated: nothing may follow. A grammar-rejected draft cannot
                        # happen (drafts are checked below); stop drafting either way.
                        s.open = False
                    else:
                        s.mask_row = res.bitmask[-1]  # [W] int32, state after d_1..d_{i-1}
            pending = [s for s in open_slots if s.open]
            for proposer in self._ordered:
                asking = [s for s in pending if proposer.name in s.seq.proposers]
                if not asking:
                    continue
                filled = set()
                for slot, proposal in zip(asking, proposer.propose(asking, position)):
                    if proposal is None:
                        continue
                    filled.add(id(slot))
                    if slot.mask_row is not None and not is_allowed(slot.mask_row, proposal.token_id):
                        # The target would reject it for certain (its mask bit is 0): stop here.
                        slot.open = False
                        continue
                    slot.add(proposal)
                    if proposal.token_id in slot.seq.stop_token_ids:
                        slot.open = False  # nothing valid follows a stop token
                pending = [s for s in pending if id(s) not in filled]
            for s in pending:
                s.open = False  # no proposer had anything for this position
            for s in open_slots:
                s.mask_row = None
        return waited

    # -- the step ---------------------------------------------------------------
    def run(self, seqs: Sequence[SequenceState]) -> list[StepOutput]:
        """One step for every sequence in ``seqs`` (each must be unfinished)."""
        errors: dict[str, str] = {}
        slots = [DraftSlot(seq, k=self.plan_k(seq)) for seq in seqs]
        mask_wait = self.propose(slots, errors)

        # Verify-path masks: in flight while the target forward runs.
        grammar_slots = [s for s in slots if s.seq.has_grammar and s.seq.seq_id not in errors]
        future = items = None
        if grammar_slots:
            assert self.masks is not None
            items = self._mask_items(grammar_slots, last_row_only=False)
            future = self.masks.draft_masks_async(items)

        live = [s for s in slots if s.seq.seq_id not in errors]
        forward_items = []
        for s in live:
            context = s.context()
            forward_items.append(
                ForwardItem(s.seq.target_kv, context[s.seq.target_kv.length :], num_logits=len(s.drafts) + 1)
            )
        logits = self.target.forward(forward_items)  # per slot [k_r + 1, V] float32

        mask_results: dict[str, Any] = {}
        if future is not None:
            reply = self._collect(future, grammar_slots, items)
            mask_wait += reply.wait_s
            errors.update(reply.errors)
            mask_results = reply.results

        outputs: dict[str, StepOutput] = {}
        to_verify: list[tuple[DraftSlot, VerifyInput]] = []
        for s, slot_logits in zip(live, logits):
            seq = s.seq
            if seq.seq_id in errors:
                continue
            mask = None
            if seq.has_grammar:
                res = mask_results[seq.seq_id]
                if res.terminated:
                    # Committed state already complete (e.g. a grammar stop token outside
                    # our stop set ended it last step): nothing more may be emitted.
                    outputs[seq.seq_id] = StepOutput(seq.seq_id, [], FinishReason.GRAMMAR_COMPLETE, target_forwards=1)
                    continue
                mask = res.bitmask  # [k_r + 1, W] int32
            p = seq.request.sampling
            to_verify.append(
                (
                    s,
                    VerifyInput(
                        drafts=s.drafts,
                        q_rows=s.q_rows,
                        logits=slot_logits,
                        mask=mask,
                        temperature=p.temperature,
                        top_k=p.top_k,
                        top_p=p.top_p,
                        seed=seq.seed,
                        step=seq.step,
                    ),
                )
            )
        verified = verify(
            [v for _, v in to_verify],
            vocab_size=self.target.vocab_size,
            num_mask_words=(self.target.vocab_size + 31) // 32,
            kernel_backend=self.kernel_backend,
        )
        for (s, _), result in zip(to_verify, verified):
            outputs[s.seq.seq_id] = self._commit(s, result.emitted, result.num_accepted)
        for seq_id, message in errors.items():
            outputs[seq_id] = StepOutput(seq_id, [], FinishReason.ERROR, error=message)
        for out in outputs.values():
            out.mask_time_s = mask_wait
        return [outputs[s.seq.seq_id] for s in slots]

    def _commit(self, slot: DraftSlot, emitted: list[int], num_accepted: int) -> StepOutput:
        seq = slot.seq
        old_len = len(seq.token_ids)
        kept, reason = seq.commit(emitted, max_model_len=self.max_model_len)
        # Cache entries past the accepted drafts (or past the kept tokens, after a
        # truncation) hold rejected tokens: roll both caches back. The newest committed
        # token is never cached; the next step feeds it.
        valid = min(old_len + min(num_accepted, len(kept)), len(seq.token_ids) - 1)
        for kv in (seq.target_kv, seq.draft_kv):
            if kv is not None and kv.length > valid:
                kv.crop(valid)
        logger.debug(
            "seq %s: k=%d accepted=%d emitted=%s kept=%d finish=%s",
            seq.seq_id, len(slot.drafts), num_accepted, emitted, len(kept), reason,
        )
        return StepOutput(
            seq.seq_id,
            kept,
            reason,
            drafts_proposed=len(slot.drafts),
            drafts_accepted=num_accepted,
            target_forwards=1,
        )
