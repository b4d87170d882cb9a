"""One decoding step for a batch of sequences (docs/design.md "One decoding step").

    plan k_r -> propose d_1..d_k (drafting.py) -> send verify masks (async) ->
    target forward over [uncached committed tokens, d_1..d_k] -> wait for masks
    -> mask + rejection sample -> commit: append tokens, crop KV caches, finish
    -> send the next step's position-1 draft masks (carrying this commit).

Mask-service traffic per step: one batched request on the verify path, in
flight while the target forward runs. With draft-side masking or grammar-forced
drafts, proposal adds one batched request per draft position, each in flight
while that position's draft forward runs (drafting.py), except position 1, whose
rows were requested right after the previous step's commit. Those requests
already returned M_0..M_{k-1}, so the verify request asks such a sequence only
for M_k (last_row_only), and the mask service never computes a row twice.
Every request carries the sequence's pending (commit_tokens, commit_seq); the
first to arrive applies it, the rest are no-ops, so there is no separate commit
round trip.

Mask rows stay in one form from the reply to the kernels: slots of the mask
client's interned table (``DraftMaskResult.rows``), turned into row ids into
the device-resident mirror (``gpu_worker.mask_table``) by the draft-side masking
and by the verifier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from specmask.common.proposer_kind import ProposerKind
from specmask.gpu_worker.drafting import Drafter
from specmask.gpu_worker.mask_errors import MaskFailure
from specmask.gpu_worker.mask_table import DeviceMaskTable
from specmask.gpu_worker.masks import MaskChannel, mask_item
from specmask.gpu_worker.model_runner import DeviceTail, ForwardItem, ModelRunner
from specmask.gpu_worker.proposers.base import DraftSlot, Proposer
from specmask.gpu_worker.sampling_cache import SamplingCache
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.speculation_gate import Arm, BatchKind, SpeculationGate
from specmask.gpu_worker.token_cost import TokenCost
from specmask.gpu_worker.types import MIN_TOKENS_UNREACHABLE, ErrorKind, FinishReason, StepOutput
from specmask.gpu_worker.verifier import VerifyInput, verify
from specmask.gpu_worker.verify_width import WidthChooser
from specmask.kernels.backend import Backend
from specmask.mask_service.client.row_table import MaskRow, MaskRows

if TYPE_CHECKING:
    from specmask.mask_service.client.mask_client import DraftMaskResult

logger = logging.getLogger(__name__)

# Seconds to wait for a mask-service answer beyond the router's own deadline
# and retries, before the step gives up on the grammar sequences of the batch.
_MASK_WAIT_SLACK_S = 5.0


class Riders(Protocol):
    """Forward items that ride in a step's target forward (``StepRunner.run``)."""

    def take(self, used: float) -> Sequence[ForwardItem]:
        """The items to add, given what the step's own rows cost (budget tokens)."""
        ...

    def failed(self, exc: Exception) -> None:
        """The forward with them failed; the step goes on without them."""
        ...


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
        kernel_backend: Backend | None = None,
        mask_table: DeviceMaskTable | None = None,
        width: WidthChooser | None = None,
        gate: SpeculationGate | None = None,
    ) -> None:
        self.target = target
        # Picks each slot's verify width (drafts kept) after proposal; each runner learns its own
        # acceptance rates unless given a chooser (benchmarks replaying recorded widths).
        self.width: WidthChooser = width if width is not None else WidthChooser.for_device(target.device.type)
        # Decides before proposal whether a step drafts at all (speculation_gate.py): from the
        # measured tokens per second of steps with and without drafts.
        self.gate: SpeculationGate = gate if gate is not None else SpeculationGate()
        self.last_arm = Arm.SPECULATE  # what the latest step did with its drafts (benches report it)
        # The device mirror of the mask rows, shared with the draft-side masking.
        self.mask_table = mask_table if mask_table is not None else DeviceMaskTable(target.device)
        self.masks = masks
        self.max_model_len = max_model_len
        self.draft_max_len = draft_max_len
        self.mask_timeout_s = mask_timeout_s + _MASK_WAIT_SLACK_S
        self.kernel_backend = kernel_backend
        # The verify batch's sampling parameters on the device, built once per batch composition.
        self.sampling = SamplingCache(target.device)
        self.drafter = Drafter(proposers, masks, mask_timeout_s=self.mask_timeout_s)

    # -- planning -----------------------------------------------------------
    def plan_k(self, seq: SequenceState) -> int:
        """k_r for this step: 0 when speculation is off, or when x + K would pass a
        model's maximum length (the sequence then decodes plainly in the same batch).
        Also capped at the remaining output budget minus one: drafts past max_tokens
        would be truncated anyway (exactness is unaffected by any k_r)."""
        if seq.k == 0 or not seq.proposers:
            return 0
        limit = self.max_model_len
        if ProposerKind.DRAFT_MODEL in seq.proposers and self.draft_max_len is not None:
            limit = min(limit, self.draft_max_len)
        if len(seq.token_ids) + seq.k > limit:
            return 0
        remaining = seq.request.sampling.max_tokens - seq.num_output
        return max(0, min(seq.k, remaining - 1))

    # -- the step ---------------------------------------------------------------
    def run(
        self,
        seqs: Sequence[SequenceState],
        joiners: Callable[[], Sequence[SequenceState]] | None = None,
        *,
        token_budget: float | None = None,
        riders: Riders | None = None,
    ) -> list[StepOutput]:
        """One step for every sequence in ``seqs`` (each must be unfinished), and for those
        ``joiners`` returns once the drafts are proposed: sequences that became ready to step
        meanwhile (the actor's newly added ones whose mask session has just opened). They join
        the verify forward without drafts (k_r = 0): the forward feeds their prompt and they
        emit one token, instead of sitting the whole step out.

        ``token_budget``: the most the target forward of ``seqs`` may cost, in budget tokens
        (gpu_worker.token_cost; the worker's iteration budget less what it keeps for prefill);
        drafts are trimmed, widest rows first, until the rows' uncached tokens plus their
        drafts fit (``trim_to_budget``). Joiners are the caller's to fit into what is left.

        ``riders``: asked once the rows are final (drafts proposed and trimmed, joiners in),
        with what those rows cost, for forward items that ride in the same target forward with
        no logits (prompt chunks, actor.py), so an iteration that reads a prompt reads the
        weights once. Their caches advance; nothing else in the step sees them. If that forward
        fails, the step's rows are forwarded again alone and the riders are told
        (``Riders.failed``): a prompt that cannot be read fails only its own sequence."""
        started = time.perf_counter()
        errors: dict[str, MaskFailure] = {}  # seq_id -> why its mask call failed
        ks = [self.plan_k(seq) for seq in seqs]
        kind = self.batch_kind(seqs)
        if not any(ks):
            arm = Arm.PLAIN
        elif any(_replays(seq) for seq in seqs):
            # The gate chooses by wall clock, and a seeded row's randomness follows its steps:
            # with a seeded sampled row in the batch, the step drafts as planned, so that row's
            # output replays exactly whatever the machine's speed (docs/performance.md).
            arm = Arm.SPECULATE
        else:
            arm = self.gate.choose(kind)
        self.last_arm = arm
        if not arm.drafts:
            ks = [0] * len(ks)  # plain decoding this step: speculation measured slower (or off)
        if token_budget is not None:
            ks = trim_to_budget(
                [seq.target_kv.length for seq in seqs],
                [uncached(seq) for seq in seqs],
                ks,
                token_budget,
                self.target.cost,
            )
        slots = [DraftSlot(seq, k=k) for seq, k in zip(seqs, ks, strict=True)]
        mask_wait = self.drafter.propose(slots, errors, masked=arm is not Arm.SPECULATE_UNMASKED)
        self.width.trim([s for s in slots if s.seq.seq_id not in errors])
        late = joiners() if joiners is not None else ()
        slots.extend(DraftSlot(seq, k=0) for seq in late)

        # Verify-path masks M_0..M_k: in flight while the target forward runs. Rows the
        # proposal phase already received are not computed again: a sequence drafted
        # with masks asks only for M_k, and one that already holds all k_r + 1 rows
        # (drafting stopped after its last mask) asks for nothing.
        grammar_slots = [s for s in slots if s.seq.has_grammar and s.seq.seq_id not in errors]
        asking = [s for s in grammar_slots if len(s.grammar_rows) <= s.num_drafts]
        pending = None
        if asking:
            assert self.masks is not None
            for s in asking:
                s.read_device()  # the request carries the drafts: one batched read for the batch
            items = [mask_item(s.seq, s.drafts, last_row_only=_needs_last_row_only(s)) for s in asking]
            pending = self.masks.request(items, timeout_s=self.mask_timeout_s)

        live = [s for s in slots if s.seq.seq_id not in errors]
        forward_items = [_verify_item(s) for s in live]
        riding: Sequence[ForwardItem] = ()
        if riders is not None:
            cost = self.target.cost
            riding = riders.take(sum(cost.span(it.kv.length, it.length) for it in forward_items))
        try:
            # Per slot [k_r + 1, V] float32 (riders, asking for none, come last and are dropped).
            logits = self.target.forward([*forward_items, *riding])[: len(live)]
        except Exception as exc:
            if not riding:
                raise
            # No cache advanced (the runner counts new entries only after the whole forward).
            assert riders is not None
            riders.failed(exc)
            logits = self.target.forward(forward_items)

        mask_results: dict[str, DraftMaskResult] = {}  # session_id -> its rows
        if pending is not None:
            reply = pending.wait()
            mask_wait += reply.wait_s
            for s in asking:
                if s.seq.session_id in reply.errors:
                    errors[s.seq.seq_id] = reply.errors[s.seq.session_id]
            mask_results = reply.results

        outputs: dict[str, StepOutput] = {}
        to_verify: list[tuple[DraftSlot, VerifyInput]] = []
        for s, slot_logits in zip(live, logits):
            seq = s.seq
            if seq.seq_id in errors:
                continue
            # [k_r + 1] rows M_0..M_k (slots of the client's row table, one block where they share
            # a table epoch); None = no grammar.
            mask: MaskRows | list[MaskRow] | None = None
            if seq.has_grammar and seq.session_id not in mask_results:
                # Every row came with the draft-side masks (which also say the
                # committed state is not terminated: they were handed out).
                joined = MaskRows.join(s.grammar_rows)
                mask = s.grammar_rows if joined is None else joined
            elif seq.has_grammar:
                res = mask_results[seq.mask_session]
                if res.terminated:
                    # Committed state already complete (e.g. a grammar stop token outside
                    # our stop set ended it last step): nothing more may be emitted.
                    short = seq.stop_suppressed(1) > 0  # ended before min_tokens: not a success
                    outputs[seq.seq_id] = StepOutput(
                        seq.seq_id,
                        [],
                        FinishReason.ERROR if short else FinishReason.GRAMMAR_COMPLETE,
                        error=f"{MIN_TOKENS_UNREACHABLE}: the grammar ended after {seq.num_output} output tokens "
                        f"(min_tokens={seq.request.sampling.min_tokens})"
                        if short
                        else None,
                        error_kind=ErrorKind.MIN_TOKENS_UNREACHABLE if short else None,
                        target_forwards=1,
                    )
                    continue
                mask = res.rows  # M_0..M_k, or [M_k] after the reused rows
                if _needs_last_row_only(s):
                    joined = MaskRows.join(s.grammar_rows, res.rows)
                    mask = [*s.grammar_rows, *res.rows] if joined is None else joined
            p = seq.request.sampling
            to_verify.append(
                (
                    s,
                    VerifyInput(
                        drafts=s.drafts,
                        q_rows=s.q_rows,
                        device=s.device,
                        device_row=s.device_row,
                        num_device=s.num_drafts if s.device is not None else 0,
                        logits=slot_logits,
                        mask=mask,
                        temperature=p.temperature,
                        top_k=p.top_k,
                        top_p=p.top_p,
                        seed=seq.seed,
                        step=seq.step,
                        logprobs=p.logprobs,
                        min_p=p.min_p,
                        stop_suppressed=seq.stop_suppressed(s.num_drafts + 1),
                        stop_token_ids=seq.min_tokens_stop_ids,
                    ),
                )
            )
        verified = verify(
            [v for _, v in to_verify],
            vocab_size=self.target.vocab_size,
            num_mask_words=(self.target.vocab_size + 31) // 32,
            kernel_backend=self.kernel_backend,
            mask_table=self.mask_table,
            sampling_cache=self.sampling,
        )
        for (s, _), result in zip(to_verify, verified):
            if result.error is not None:
                outputs[s.seq.seq_id] = StepOutput(
                    s.seq.seq_id,
                    [],
                    FinishReason.ERROR,
                    error=f"{result.error} (min_tokens={s.seq.request.sampling.min_tokens}, "
                    f"{s.seq.num_output} output tokens so far)",
                    error_kind=result.error_kind,
                    drafts_proposed=s.num_drafts,
                    target_forwards=1,
                )
                continue
            if result.violation is not None:
                # Never commit or return the token: only this sequence fails.
                logger.error(
                    "[request_id=%s] seq %s: grammar violation caught on device: %s",
                    s.seq.request_id,
                    s.seq.seq_id,
                    result.violation,
                )
                outputs[s.seq.seq_id] = StepOutput(
                    s.seq.seq_id,
                    [],
                    FinishReason.GRAMMAR_VIOLATION,
                    error=f"grammar violation: {result.violation}",
                    drafts_proposed=s.num_drafts,
                    target_forwards=1,
                )
                continue
            self.width.record(s, result.num_accepted)
            out = outputs[s.seq.seq_id] = self._commit(s, result.emitted, result.num_accepted)
            if result.logprobs is not None:
                # The kept tokens are a prefix of the emitted ones (a stop token or the budget
                # cuts the tail): so are their logprobs.
                out.logprobs = result.logprobs[: len(out.new_token_ids)]
        for seq_id, failure in errors.items():
            outputs[seq_id] = failure.output(seq_id)
        for out in outputs.values():
            out.mask_time_s = mask_wait
        if not late and not riding:
            # Only the batch's own steps measure it: joiners' prompts and riders are not its cost.
            self.gate.record(
                kind,
                arm,
                seconds=time.perf_counter() - started,
                rows=len(seqs),
                tokens=sum(len(outputs[seq.seq_id].new_token_ids) for seq in seqs),
            )
        # Position-1 masks of the next step depend only on this commit: send them now,
        # so they are computed while the caller handles this step's outputs (unless the
        # next step is expected to decode plainly, or to draft without draft-side masks:
        # nothing would read them).
        going_on = [s.seq for s in slots if outputs[s.seq.seq_id].finish_reason is None]
        masked_next = any(_replays(seq) for seq in going_on) or (
            self.gate.choose(self.batch_kind(going_on)) is Arm.SPECULATE
        )
        self.drafter.prefetch_first([seq for seq in going_on if masked_next and self.plan_k(seq) > 0])
        return [outputs[s.seq.seq_id] for s in slots]

    def batch_kind(self, seqs: Sequence[SequenceState]) -> BatchKind:
        """What the speculation gate measures a batch of ``seqs`` under."""
        return BatchKind.of(
            len(seqs),
            constrained=any(seq.has_grammar for seq in seqs),
            draft_masks=any(
                seq.has_grammar and seq.request.speculation.draft_masking and ProposerKind.DRAFT_MODEL in seq.proposers
                for seq in seqs
            ),
            sampled=any(seq.request.sampling.temperature > 0 for seq in seqs),
            unmaskable=self.drafter.draft_model is not None
            and all(ProposerKind.DRAFT_MODEL in seq.proposers for seq in seqs),
        )

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
            seq.seq_id,
            slot.num_drafts,
            num_accepted,
            emitted,
            len(kept),
            reason,
        )
        return StepOutput(
            seq.seq_id,
            kept,
            reason,
            drafts_proposed=slot.num_drafts,
            drafts_accepted=num_accepted,
            target_forwards=1,
        )


def uncached(seq: SequenceState) -> int:
    """Committed tokens the target has not cached: what the sequence's next forward feeds
    before its drafts (1 after a step; a new sequence's prompt tail before its first)."""
    return len(seq.token_ids) - seq.target_kv.length


def trim_to_budget(
    starts: Sequence[int], base: Sequence[int], ks: Sequence[int], budget: float, cost: TokenCost
) -> list[int]:
    """Per-row draft counts ``ks`` cut so that the rows' cost, each feeding ``base[r] + ks[r]``
    tokens from position ``starts[r]`` (``cost.span``), fits ``budget`` where possible: one
    draft at a time from the row with the most, so every row keeps an equal share. Rows'
    ``base`` tokens are never cut (a row that steps feeds at least its uncached tokens)."""
    out = list(ks)
    spans = [cost.span(p, b + k) for p, b, k in zip(starts, base, out, strict=True)]
    excess = sum(spans) - budget
    while excess > 0 and any(out):
        widest = max(range(len(out)), key=out.__getitem__)
        out[widest] -= 1
        cut = cost.span(starts[widest], base[widest] + out[widest])
        excess -= spans[widest] - cut
        spans[widest] = cut
    return out


def _needs_last_row_only(slot: DraftSlot) -> bool:
    """Whether the verify path needs only M_k for ``slot``: the draft-side requests
    returned M_0..M_{k-1} (with k = 0, M_0 is the only row either way)."""
    return len(slot.grammar_rows) == slot.num_drafts


def _verify_item(slot: DraftSlot) -> ForwardItem:
    """``slot``'s verify-forward row: its uncached committed tokens, then its drafts (from the
    device when the device draft loop sampled them, read back or not)."""
    seq, kv = slot.seq, slot.seq.target_kv
    n = slot.num_drafts
    if slot.device is not None and n:
        return ForwardItem(kv, seq.token_ids[kv.length :], n + 1, DeviceTail(slot.device.tokens, slot.device_row, 0, n))
    return ForwardItem(kv, slot.context()[kv.length :], num_logits=n + 1)


def _replays(seq: SequenceState) -> bool:
    """Whether ``seq`` promises a reproducible sampled output: a seed the caller gave, and
    sampling (a greedy row's output is the same whichever steps draft)."""
    sampling = seq.request.sampling
    return sampling.seed is not None and sampling.temperature > 0.0
