"""Grammar-forced drafts: where the grammar allows exactly one token, propose it.

No model runs for such a position and q = 1 (one-hot). This stays exact because
the target still verifies the token like any other draft (docs/design.md step 1);
under greedy decoding a forced token is accepted iff the masked target's argmax
is that token, which it always is when the mask row has a single allowed token.
Detected from the row's allowed-token count, which the mask service sends with
the row (``NewRow.allowed_count``): no popcount on the worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from specmask.common.proposer_kind import ProposerKind
from specmask.gpu_worker.proposers.base import DraftSlot, Proposal, Proposer, ProposerResources
from specmask.gpu_worker.proposers.registry import register


@register
class GrammarForcedProposer(Proposer):
    name = ProposerKind.GRAMMAR_FORCED
    priority = 0  # free and certain: always first
    needs_masks = True

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size  # V: bits >= V stand for no token

    @classmethod
    def create(cls, resources: ProposerResources) -> GrammarForcedProposer:
        return cls(resources.vocab_size)

    def propose(self, slots: Sequence[DraftSlot], position: int) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for slot in slots:
            token = None if slot.mask_row is None else slot.mask_row.forced_token(self.vocab_size)
            out.append(None if token is None else Proposal(token))
        return out
