"""Prompt-lookup (n-gram) drafts: continue the context the way it continued before.

Find the longest suffix of (committed tokens + drafts so far), n from
ngram_max down to ngram_min, that occurred earlier in the same context, and
propose the token that followed its most recent earlier occurrence (prompt
lookup decoding, Saxena 2023; vLLM's ngram proposer). q = 1 (one-hot). When a
grammar mask row is known for the position, a disallowed candidate is not
proposed (it would be rejected for certain).
"""

from __future__ import annotations

from collections.abc import Sequence

from specmask.common.proposer_kind import ProposerKind
from specmask.gpu_worker.proposers.base import DraftSlot, Proposal, Proposer, ProposerResources
from specmask.gpu_worker.proposers.registry import register


def lookup_next(context: Sequence[int], n_min: int, n_max: int) -> int | None:
    """The token after the latest earlier occurrence of the longest matching suffix."""
    length = len(context)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = list(context[length - n :])
        # Scan start positions right to left; the match must end before the suffix itself.
        for start in range(length - n - 1, -1, -1):
            if list(context[start : start + n]) == suffix:
                return int(context[start + n])
    return None


@register
class NgramProposer(Proposer):
    name = ProposerKind.NGRAM
    priority = 10  # after grammar-forced, before the draft model (no forward needed)

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max

    @classmethod
    def create(cls, resources: ProposerResources) -> NgramProposer:
        return cls(resources.ngram_min, resources.ngram_max)

    def chain(self, context: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens the lookup predicts after ``context``, each on the
        context extended by the ones before it: what ``propose`` would give position
        by position if every proposal were kept (no mask applied here)."""
        ctx = list(context)
        out: list[int] = []
        while len(out) < limit:
            token = lookup_next(ctx, self.n_min, self.n_max)
            if token is None:
                break
            out.append(token)
            ctx.append(token)
        return out

    def _candidate(self, slot: DraftSlot) -> int | None:
        """The lookup's token for the slot's current context, looked up once per context
        (``foresees`` and ``propose`` both ask; a reply applied in between may add drafts, so
        the cache is keyed by the number of drafts, and cleared with ``DraftSlot.prepared``)."""
        cached = slot.prepared.get(self.name)
        if cached is None or cached[0] != len(slot.drafts):
            cached = (len(slot.drafts), lookup_next(slot.context(), self.n_min, self.n_max))
            slot.prepared[self.name] = cached
        token: int | None = cached[1]
        return token

    def foresees(self, slot: DraftSlot) -> bool:
        """A candidate the known row (if any) allows: then ``propose`` fills the slot unless the
        row, still in flight, refuses it (rare: the context repeats itself under the same grammar)."""
        token = self._candidate(slot)
        return token is not None and (slot.mask_row is None or slot.mask_row.allows(token))

    def propose(self, slots: Sequence[DraftSlot], position: int) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for slot in slots:
            token = self._candidate(slot)
            if token is not None and slot.mask_row is not None and not slot.mask_row.allows(token):
                token = None
            out.append(None if token is None else Proposal(token))
        return out
