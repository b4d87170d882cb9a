"""The proposal phase of a step: d_1..d_k per sequence, position by position.

Owns ``Drafter``: the per-position loop over the proposers, the draft-side mask
requests sent beside each draft forward (and ``prefetch_first``'s M_0 after a
commit), forced continuations and n-gram lookahead taken from a reply. How the
mask traffic stays off the critical path is in docs/design.md, "Mask traffic
during proposal".

The device draft loop: when no slot of the batch needs a mask row while it drafts
(no grammar, or draft masks off) and every slot that drafts does so with the draft
model alone, nothing in proposal needs a draft token on the host, so the
per-position loop below is skipped: ``DraftModelProposer.draft_on_device`` runs all
k positions with the tokens in a device tensor, and the step hands them to the
verify forward and the rejection sampler as device tensors too. The step then reads
the device once (its verified tokens), plus once for the drafts where a verify-path
mask request carries them (docs/performance.md, "The step's host path").
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from specmask.common.proposer_kind import ProposerKind
from specmask.gpu_worker.mask_errors import MaskFailure
from specmask.gpu_worker.masks import MaskChannel, MaskReply, PendingMasks, mask_item
from specmask.gpu_worker.proposers.base import DraftSlot, Proposal, Proposer
from specmask.gpu_worker.proposers.draft_model import DraftModelProposer
from specmask.gpu_worker.sequence import SequenceState

if TYPE_CHECKING:
    from specmask.mask_service.client.mask_client import DraftMaskItem
    from specmask.mask_service.client.row_table import MaskRow

# DraftSlot.sources name for drafts taken from the service's forced continuation (the
# sequences that draft with ProposerKind.GRAMMAR_FORCED also take those).
FORCED_CONTINUATION = "forced_continuation"
# The proposers the lookahead walk reproduces: a sequence whose proposers ranked up to the
# n-gram one are among these sends its n-gram lookahead with each draft-side request (see
# "Lookahead" in the module note).
LOOKAHEAD_PROPOSERS = frozenset({ProposerKind.GRAMMAR_FORCED, ProposerKind.NGRAM})


@runtime_checkable
class Lookahead(Protocol):
    """What the drafter asks of the n-gram proposer beyond ``propose`` (proposers.ngram)."""

    def chain(self, context: Sequence[int], limit: int) -> list[int]: ...


@runtime_checkable
class ForcedTokens(Protocol):
    """What the drafter asks of the grammar-forced proposer beyond ``propose``: the vocabulary
    size that ``MaskRow.forced_token`` reads a row's bits against (proposers.grammar_forced)."""

    vocab_size: int


class ChainWalk(enum.Enum):
    """Where ``Drafter._walk`` left a slot on its lookahead."""

    WHOLE = enum.auto()  # took every chain token; slot.mask_row = the row after them
    LEFT = enum.auto()  # left the chain with a token of its own; the next row is not known
    REFUSED = enum.auto()  # stopped where the service's walk did (its n-gram token refused)
    CLOSED = enum.auto()  # drafting ended for this step (a stop token, or a row never filled)


class Drafter:
    """Fills ``DraftSlot.drafts`` for a batch; owns the draft-side mask requests."""

    def __init__(self, proposers: dict[str, Proposer], masks: MaskChannel | None, *, mask_timeout_s: float) -> None:
        self.proposers = proposers  # name -> instance, for the proposers this worker can run
        ordered = sorted(proposers.values(), key=lambda p: (p.priority, p.name))
        # Proposers up to the first one that prepares can run before any forward; the
        # rest run after it (priority order is kept either way).
        split = next((i for i, p in enumerate(ordered) if p.prepares), len(ordered))
        self._ordered = ordered
        self._before_forward = ordered[:split]
        self._from_forward = ordered[split:]
        self._preparing = [p for p in ordered if p.prepares]
        self.masks = masks
        self.mask_timeout_s = mask_timeout_s
        # The proposers the drafter calls beyond ``propose``, typed; None where this worker has
        # none (or has one a tool wrapped: bench.step_cost's recording proposers, which then
        # draft position by position).
        draft_model = proposers.get(ProposerKind.DRAFT_MODEL)
        self.draft_model = draft_model if isinstance(draft_model, DraftModelProposer) else None
        ngram = proposers.get(ProposerKind.NGRAM)
        self.ngram: Lookahead | None = ngram if isinstance(ngram, Lookahead) else None
        forced = proposers.get(ProposerKind.GRAMMAR_FORCED)
        self.forced: ForcedTokens | None = forced if isinstance(forced, ForcedTokens) else None
        # M_0 request sent after the previous step's commit (see prefetch_first).
        self._first: PendingMasks | None = None
        # session_id -> the lookahead that request carries (its drafts start at d_1).
        self._first_chains: dict[str, list[int]] = {}

    def wants_masks(self, seq: SequenceState) -> bool:
        """Whether proposal for ``seq`` needs its grammar mask row at each draft position."""
        if not seq.has_grammar or self.masks is None or not seq.proposers:
            return False
        if seq.request.speculation.draft_masking and ProposerKind.DRAFT_MODEL in seq.proposers:
            return True
        return any(self.proposers[n].needs_masks for n in seq.proposers if n in self.proposers)

    def prefetch_first(self, seqs: Sequence[SequenceState]) -> None:
        """Request M_0 for the next step of ``seqs`` (those that will draft) right after
        their commit; the next ``propose`` uses it for position 1. Replaces any earlier one."""
        wanted = [seq for seq in seqs if self.wants_masks(seq)]
        self._first = None
        self._first_chains = {}
        if wanted:
            assert self.masks is not None
            items = []
            for seq in wanted:
                chain = self._lookahead(seq, seq.token_ids, seq.k)
                if chain:
                    self._first_chains[seq.mask_session] = chain
                items.append(self._item(seq, (), seq.k, chain))
            self._first = self.masks.request(items, timeout_s=self.mask_timeout_s)

    def settle_prefetch(self) -> None:
        """Block until the position-1 request ``prefetch_first`` sent has been answered,
        leaving its reply for the next ``propose`` (whose wait then counts only what is
        left). For benches that model the gap a served worker spends between steps."""
        if self._first is not None:
            self._first.settle()

    def propose(self, slots: Sequence[DraftSlot], errors: dict[str, MaskFailure], *, masked: bool = True) -> float:
        """Fill slot.drafts position by position; failed sequences go to ``errors``
        (seq_id -> why). Returns seconds spent waiting on masks.

        ``masked`` False: the draft model drafts every slot alone, without draft-side mask
        rows, in the device loop (the speculation gate's ``SPECULATE_UNMASKED``, for batches
        whose every slot drafts with the draft model); proposers that need mask rows propose
        nothing this step. Exact either way: the verifier masks every position."""
        first, self._first = self._first, None
        first_chains, self._first_chains = self._first_chains, {}
        on_device = self._device_loop(slots, errors) if masked else self._unmasked(slots, errors)
        if on_device is not None:
            draft_model, drafting = on_device
            if drafting:
                draft_model.draft_on_device(drafting)
            return 0.0
        waited = 0.0
        max_k = max((s.k for s in slots), default=0)
        for position in range(1, max_k + 1):
            open_slots = [s for s in slots if s.open and len(s.drafts) < s.k and s.seq.seq_id not in errors]
            if not open_slots:
                break
            with_rows = [s for s in open_slots if self.wants_masks(s.seq)]
            if position == 1 and first is not None:
                covered = [s for s in with_rows if s.seq.session_id in first.session_ids]
                if covered:
                    for s in covered:
                        s.sent = (0, first_chains.get(s.seq.mask_session, []))
                    waited += self._apply(first.wait(), covered, errors)
                    for s in covered:  # a forced run's reply carried the row after it: no re-ask
                        if s.next_row is not None:
                            s.mask_row, s.next_row = s.next_row, None
            fetch = [
                s
                for s in with_rows
                if s.open and s.mask_row is None and len(s.drafts) < s.k and s.seq.seq_id not in errors
            ]
            pending = None
            if fetch:
                assert self.masks is not None
                items = []
                for s in fetch:
                    chain = [] if s.plain_next else self._lookahead(s.seq, s.context(), s.k - len(s.drafts))
                    s.plain_next = False
                    s.sent = (len(s.drafts), chain)
                    items.append(self._item(s.seq, s.drafts, s.k, chain))
                pending = self.masks.request(items, timeout_s=self.mask_timeout_s)
            fetching = set(fetch)
            # Re-checked against k: the position-1 reply above may have filled a slot with its
            # forced run, and a full slot must not get one more draft from the proposers below.
            ready = [
                s
                for s in open_slots
                if s.open and s not in fetching and len(s.drafts) < s.k and s.seq.seq_id not in errors
            ]

            # While the masks are in flight: cheap proposers for slots whose row is known
            # (or not needed), then one batched forward for every slot that may need it.
            ready = self._fill(ready, position, self._before_forward)
            for proposer in self._preparing:
                asking = [
                    s for s in fetch + ready if proposer.name in s.seq.proposers and not self._foreseen(s, proposer)
                ]
                if asking:
                    proposer.prepare(asking, position)
            # Slots that needed no mask finish before the wait.
            unfilled = self._fill(ready, position, self._from_forward)

            if pending is not None:
                waited += self._apply(pending.wait(), fetch, errors)
                # A slot that just took a forced run waits for the next position's row.
                live = [s for s in fetch if s.open and s.mask_row is not None and s.seq.seq_id not in errors]
                unfilled += self._fill(live, position, self._ordered)
            for s in unfilled:
                s.open = False  # no proposer had anything for this position
            for s in open_slots:
                s.mask_row, s.next_row = s.next_row, None
                s.prepared.clear()
        return waited

    def _device_loop(
        self, slots: Sequence[DraftSlot], errors: dict[str, MaskFailure]
    ) -> tuple[DraftModelProposer, list[DraftSlot]] | None:
        """The draft model and the slots it drafts for, when the whole batch can draft in the
        device loop (``DraftModelProposer.draft_on_device``): every slot that drafts this step
        drafts with the draft model alone and no mask row (no grammar, or draft masks off).
        None otherwise: the loop below then proposes position by position."""
        if self.draft_model is None:
            return None
        drafting = [s for s in slots if s.k > 0 and s.seq.seq_id not in errors]
        for s in drafting:
            if self.wants_masks(s.seq):
                return None
            # A proposer that drafts from mask rows (grammar-forced) proposes nothing for a
            # slot that never gets one: without a grammar (SpeculationParams' default names
            # it beside the draft model) the draft model drafts alone.
            runnable = {
                name for name in s.seq.proposers if name in self.proposers and not self.proposers[name].needs_masks
            }
            if runnable != {ProposerKind.DRAFT_MODEL}:
                return None
        return self.draft_model, drafting

    def _unmasked(
        self, slots: Sequence[DraftSlot], errors: dict[str, MaskFailure]
    ) -> tuple[DraftModelProposer, list[DraftSlot]] | None:
        """The device loop for every drafting slot, draft-side masks or not; None (proposal
        as requested) where the worker has no draft model or a slot does not draft with it."""
        drafting = [s for s in slots if s.k > 0 and s.seq.seq_id not in errors]
        if self.draft_model is None or any(ProposerKind.DRAFT_MODEL not in s.seq.proposers for s in drafting):
            return self._device_loop(slots, errors)
        return self.draft_model, drafting

    def _foreseen(self, slot: DraftSlot, preparing: Proposer) -> bool:
        """Whether a proposer ahead of ``preparing`` that needs no forward expects to fill
        ``slot`` at this position (``Proposer.foresees``): ``preparing`` then skips its work for
        the slot, which costs nothing if the guess holds (that proposer's proposal wins anyway)
        and a late, unbatched ``prepare`` for the slot if the row refuses it."""
        return any(
            p.priority < preparing.priority and p.name in slot.seq.proposers and p.foresees(slot)
            for p in self._before_forward
        )

    def _lookahead(self, seq: SequenceState, context: Sequence[int], limit: int) -> list[int]:
        """The n-gram continuation of ``context`` to send with ``seq``'s draft-side request:
        [] unless ``seq`` drafts with the n-gram proposer and nothing but grammar-forced drafts
        ranks ahead of it."""
        ngram = self.proposers.get(ProposerKind.NGRAM)
        if ngram is None or self.ngram is None or limit <= 0 or ProposerKind.NGRAM not in seq.proposers:
            return []
        # The walk (_walk) reproduces exactly the proposers ranked up to the n-gram one; those
        # ranked after it (the draft model) only fill positions the n-gram lookup has nothing
        # for, which is where the chain ends and the walk hands the slot back to them.
        ahead = {n for n in seq.proposers if n in self.proposers and self.proposers[n].priority <= ngram.priority}
        if not LOOKAHEAD_PROPOSERS.issuperset(ahead):
            return []
        return self.ngram.chain(context, limit)

    @staticmethod
    def _item(seq: SequenceState, drafts: Sequence[int], k: int, chain: Sequence[int] = ()) -> DraftMaskItem:
        """The draft-side request for the row after ``drafts`` (and, with a lookahead
        ``chain``, every row along it), asking for the forced continuation after them (up
        to the drafts ``k`` still allows) when ``seq`` takes them."""
        forcing = ProposerKind.GRAMMAR_FORCED in seq.proposers
        up_to = k if forcing else 0  # where the service's walk stops, drafts up to k in all
        if chain:
            return mask_item(seq, [*drafts, *chain], last_row_only=False, forced_up_to=up_to, forced_rows=forcing)
        return mask_item(seq, drafts, last_row_only=True, forced_up_to=up_to, forced_rows=forcing)

    def _apply(
        self,
        reply: MaskReply,
        slots: Sequence[DraftSlot],
        errors: dict[str, MaskFailure],
    ) -> float:
        """Give each slot its row from ``reply`` (or its error), walk its lookahead if it sent
        one, then take the forced run if the reply has one for where the slot stands (the
        row is then stale: cleared); returns the wait. Each slot's ``sent`` says what its
        request carried (taken and cleared here)."""
        for s in slots:
            session_id = s.seq.mask_session  # every slot here sent a request
            base, chain = s.sent if s.sent is not None else (len(s.drafts), [])
            s.sent = None  # answered
            if session_id in reply.errors:
                errors[s.seq.seq_id] = reply.errors[session_id]
                continue
            res = reply.results.get(session_id)
            if res is None or res.terminated or res.num_grammar_accepted < base or len(s.drafts) != base:
                # Terminated: nothing may follow. A grammar-rejected draft cannot
                # happen (drafts are checked in _fill); stop drafting either way.
                s.open = False
                continue
            rows = list(res.rows)[base:] if chain else [res.rows[-1]]  # M_base.. along the lookahead
            s.mask_row = rows[0]  # a slot of the client's row table: state after d_1..d_{i-1}
            if len(s.grammar_rows) == len(s.drafts):  # M_0..M_{i-1} with no gap (none after a forced run)
                s.grammar_rows.append(s.mask_row)
            if chain:
                walked = self._walk(s, chain, rows, res.num_grammar_accepted - base, run_at_stop=res.forced_at_stop)
                if walked is ChainWalk.REFUSED and not res.forced_at_stop:
                    # No forced run was asked for (no forced drafts): ask this state again, without
                    # a lookahead (if nothing is forced there, drafting stops then).
                    s.mask_row = None
                    s.plain_next = True
                    continue
                if walked is ChainWalk.LEFT or walked is ChainWalk.CLOSED:
                    continue  # left the lookahead (or stopped): the reply's forced run is not for here
            forced = res.forced_tokens[: s.k - len(s.drafts)] if ProposerKind.GRAMMAR_FORCED in s.seq.proposers else ()
            if forced:
                after = res.forced_rows  # one per forced token: _item asks for them with every run
                if after is None or len(after) < len(forced):
                    errors[s.seq.seq_id] = MaskFailure.internal(
                        "mask service sent a forced run without the row after each token"
                    )
                    continue
                for j, token in enumerate(forced):
                    s.add(Proposal(token), FORCED_CONTINUATION)  # q = 1; every forced token is grammar-accepted
                    if len(s.grammar_rows) == len(s.drafts):
                        s.grammar_rows.append(after[j])  # M after this token: verification needs no request
                if len(s.drafts) < s.k:
                    s.next_row = after[len(forced) - 1]  # the next position's row came with the run
            if forced or len(s.drafts) >= s.k:
                s.mask_row = None
        return reply.wait_s

    def _walk(
        self, slot: DraftSlot, chain: Sequence[int], rows: Sequence[MaskRow], accepted: int, *, run_at_stop: bool
    ) -> ChainWalk:
        """Draft along ``chain`` with its rows (rows[j] = the mask before chain[j]), as the
        proposers would position by position: the grammar-forced token where a row allows
        one token, else the n-gram token if its row allows it. ``accepted``: how many chain
        tokens the service's walk accepted; rows past that state were not filled (all-ones)
        and are never read. Where the service's walk stopped (the chain's token was refused
        there) and the reply carries the forced run of that state (``run_at_stop``), the walk
        stops too, even at a row that forces one token: that run starts with the token and
        may go on (a key's closing quote, the colon, the next key), and the caller takes it
        whole. Without such a run, a row that forces one token is followed as position by
        position drafting would, and the next request's lookahead starts after it. Returns how
        the slot left the chain (ChainWalk); at REFUSED slot.mask_row is the row of that state."""
        forcing = ProposerKind.GRAMMAR_FORCED in slot.seq.proposers and self.forced is not None
        vocab_size = self.forced.vocab_size if self.forced is not None else None
        for j, candidate in enumerate(chain):
            if j > accepted:
                # Not reached by the service's walk; cannot happen (at j == accepted the
                # walk below leaves the chain or stops), but never read an unfilled row.
                slot.open = False
                return ChainWalk.CLOSED
            row = rows[j]
            if len(slot.drafts) >= slot.k:
                slot.mask_row = None
                return ChainWalk.LEFT
            if j == accepted and run_at_stop:
                slot.mask_row = row  # the caller takes the reply's forced run from here
                return ChainWalk.REFUSED
            forced = row.forced_token(vocab_size) if forcing and vocab_size is not None else None
            if forced is not None:
                token, source = forced, ProposerKind.GRAMMAR_FORCED
            elif j < accepted and row.allows(candidate):
                token, source = candidate, ProposerKind.NGRAM
            else:
                # The n-gram token is refused here (j == accepted): the service's walk stopped
                # at this state, and the caller takes the forced run the reply has for it.
                slot.mask_row = row
                return ChainWalk.REFUSED
            slot.add(Proposal(token), source)
            if token in slot.seq.stop_token_ids:
                slot.open = False  # nothing valid follows a stop token
                return ChainWalk.CLOSED
            if token != candidate or j + 1 >= len(rows):
                slot.mask_row = None  # off the lookahead: the row after this token was not asked for
                return ChainWalk.LEFT
            slot.mask_row = rows[j + 1]
            if len(slot.grammar_rows) == len(slot.drafts):
                slot.grammar_rows.append(slot.mask_row)
        return ChainWalk.WHOLE

    @staticmethod
    def _fill(slots: Sequence[DraftSlot], position: int, proposers: Sequence[Proposer]) -> list[DraftSlot]:
        """Ask ``proposers`` in order for d_position; the first proposal wins. Returns
        the slots still open that none of them filled."""
        pending = list(slots)
        for proposer in proposers:
            asking = [s for s in pending if proposer.name in s.seq.proposers]
            if not asking:
                continue
            filled: set[DraftSlot] = set()
            for slot, proposal in zip(asking, proposer.propose(asking, position)):
                if proposal is None:
                    continue
                filled.add(slot)
                if slot.mask_row is not None and not slot.mask_row.allows(proposal.token_id):
                    # The target would reject it for certain (its mask bit is 0): stop here.
                    slot.open = False
                    continue
                slot.add(proposal, proposer.name)
                if proposal.token_id in slot.seq.stop_token_ids:
                    slot.open = False  # nothing valid follows a stop token
            pending = [s for s in pending if s not in filled]
        return pending
