"""The proposal phase of a step: d_1..d_k per sequence, position by position,
with the draft-side mask traffic kept off the critical path (DESIGN.md step 1).

A grammar sequence that drafts with masks (draft-side masking, or grammar-forced
drafts) needs, at draft position i, the row M_{i-1}: tokens allowed after its
committed tokens and d_1..d_{i-1}. That request depends on exactly the inputs of
the draft forward for position i, so the two run at the same time:

    position i:  send mask request (I/O thread) ──────────────┐
                 draft forward over d_{i-1} (this thread) ─────┴─ wait -> mask logits, sample d_i

and the step waits for the masks only once the draft logits exist, as the
verify path does with the target forward. A grammar-forced position (M_{i-1}
allows one token) cannot be recognised before its row arrives, so the forward
also runs for slots that turn out forced: a wasted row in a batched forward,
in exchange for never serialising a round trip in front of the forward. Its
logits are dropped; the tokens it fed stay cached (they are context either way).

Position 1 is cheaper still: M_0 is the mask after the committed tokens, so it
can be requested as soon as the previous step has committed. ``prefetch_first``
sends it then (carrying the commit, which the step's later requests repeat as
no-ops), and it arrives while the orchestrator handles the step's outputs; a
sequence it does not cover (just added) sends its own position-1 request, in
flight with the forward like any other position. With M_0 in hand, forced
first positions skip the draft forward outright.

Forced continuations (issue 15.3): for a sequence with grammar-forced drafts,
every draft-side request also asks the service for the grammar's forced
continuation after its drafts (``max_forced_tokens``). A reply with f_1..f_m
makes them the next drafts at once, q = 1 (one-hot) like any grammar-forced
draft: no draft forward and no round trip for those positions. The row the reply
carried is then stale (it is for the state before the run), so the slot asks
again, with the run among its drafts, for the position after it; at position 1
that second request is the position's own. Rows for the forced positions are not
requested on the draft side: the verify path asks such a sequence for all k+1
rows (one request, in flight with the target forward), and the target verifies
forced drafts exactly like any other.

Sequences without a grammar, or whose proposers need no masks, never wait on a
position's mask request: their whole position (cheap proposers, forward,
sampling) completes before the wait. (Position 1 waits for the prefetched rows
first, so that forced first positions are known before the one batched forward;
those rows were sent a whole inter-step gap earlier.) Sequences with speculation
off never reach this phase (k_r = 0) and are never prefetched for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from gpu_worker.bitmask_rows import is_allowed
from gpu_worker.masks import MaskChannel, MaskReply, PendingMasks, mask_item
from gpu_worker.proposers.base import DraftSlot, Proposal, Proposer
from gpu_worker.sequence import SequenceState

if TYPE_CHECKING:
    from mask_service.client import DraftMaskItem

# The proposer whose sequences also take the grammar's forced continuations.
FORCED_PROPOSER = "grammar_forced"
# DraftSlot.sources name for drafts taken from the service's forced continuation.
FORCED_CONTINUATION = "forced_continuation"


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
        # M_0 request sent after the previous step's commit (see prefetch_first).
        self._first: PendingMasks | None = None

    def wants_masks(self, seq: SequenceState) -> bool:
        """Whether proposal for ``seq`` needs its grammar mask row at each draft position."""
        if not seq.has_grammar or self.masks is None or not seq.proposers:
            return False
        if seq.request.speculation.draft_masking and "draft_model" in seq.proposers:
            return True
        return any(self.proposers[n].needs_masks for n in seq.proposers if n in self.proposers)

    def prefetch_first(self, seqs: Sequence[SequenceState]) -> None:
        """Request M_0 for the next step of ``seqs`` (those that will draft) right after
        their commit; the next ``propose`` uses it for position 1. Replaces any earlier one."""
        wanted = [seq for seq in seqs if self.wants_masks(seq)]
        self._first = None
        if wanted:
            assert self.masks is not None
            items = [self._item(seq, (), seq.k) for seq in wanted]
            self._first = self.masks.request(items, timeout_s=self.mask_timeout_s)

    def propose(self, slots: Sequence[DraftSlot], errors: dict[str, str]) -> float:
        """Fill slot.drafts position by position; failed sequences go to ``errors``
        (seq_id -> message). Returns seconds spent waiting on masks."""
        first, self._first = self._first, None
        waited = 0.0
        max_k = max((s.k for s in slots), default=0)
        for position in range(1, max_k + 1):
            open_slots = [s for s in slots if s.open and len(s.drafts) < s.k and s.seq.seq_id not in errors]
            if not open_slots:
                break
            masked = [s for s in open_slots if self.wants_masks(s.seq)]
            if position == 1 and first is not None:
                covered = [s for s in masked if s.seq.session_id in first.session_ids]
                if covered:
                    waited += self._apply(first.wait(), covered, errors)
            fetch = [
                s
                for s in masked
                if s.open and s.mask_row is None and len(s.drafts) < s.k and s.seq.seq_id not in errors
            ]
            pending = None
            if fetch:
                assert self.masks is not None
                items = [self._item(s.seq, s.drafts, s.k) for s in fetch]
                pending = self.masks.request(items, timeout_s=self.mask_timeout_s)
            fetching = {id(s) for s in fetch}
            ready = [s for s in open_slots if s.open and id(s) not in fetching and s.seq.seq_id not in errors]

            # While the masks are in flight: cheap proposers for slots whose row is known
            # (or not needed), then one batched forward for every slot that may need it.
            ready = self._fill(ready, position, self._before_forward)
            for proposer in self._preparing:
                asking = [s for s in fetch + ready if proposer.name in s.seq.proposers]
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
                s.mask_row = None
                s.prepared.clear()
        return waited

    @staticmethod
    def _item(seq: SequenceState, drafts: Sequence[int], k: int) -> DraftMaskItem:
        """The draft-side request for the row after ``drafts``, asking for the forced
        continuation (up to the drafts ``k`` still allows) when ``seq`` takes them."""
        item = mask_item(seq, drafts, last_row_only=True)
        if FORCED_PROPOSER in seq.proposers and k > len(drafts):
            item = replace(item, max_forced_tokens=k - len(drafts))
        return item

    @staticmethod
    def _apply(reply: MaskReply, slots: Sequence[DraftSlot], errors: dict[str, str]) -> float:
        """Give each slot its row from ``reply`` (or its error), then its forced run if
        the reply has one (the row is then stale: cleared); returns the wait."""
        for s in slots:
            session_id = s.seq.session_id
            if session_id in reply.errors:
                errors[s.seq.seq_id] = reply.errors[session_id]
                continue
            res = reply.results.get(session_id)
            if res is None or res.terminated or res.num_grammar_accepted < len(s.drafts):
                # Terminated: nothing may follow. A grammar-rejected draft cannot
                # happen (drafts are checked in _fill); stop drafting either way.
                s.open = False
            else:
                s.mask_row = res.rows[-1]  # a slot of the client's row table: state after d_1..d_{i-1}
                if len(s.grammar_rows) == len(s.drafts):  # M_0..M_{i-1} with no gap (none after a forced run)
                    s.grammar_rows.append(s.mask_row)
                forced = res.forced_tokens[: s.k - len(s.drafts)] if FORCED_PROPOSER in s.seq.proposers else ()
                for token in forced:
                    s.add(Proposal(token), FORCED_CONTINUATION)  # q = 1; every forced token is grammar-accepted
                if forced:
                    s.mask_row = None
        return reply.wait_s

    @staticmethod
    def _fill(slots: Sequence[DraftSlot], position: int, proposers: Sequence[Proposer]) -> list[DraftSlot]:
        """Ask ``proposers`` in order for d_position; the first proposal wins. Returns
        the slots still open that none of them filled."""
        pending = list(slots)
        for proposer in proposers:
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
                slot.add(proposal, proposer.name)
                if proposal.token_id in slot.seq.stop_token_ids:
                    slot.open = False  # nothing valid follows a stop token
            pending = [s for s in pending if id(s) not in filled]
        return pending
