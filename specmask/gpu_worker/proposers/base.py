"""The proposer interface: one draft token per sequence per draft position.

A step builds drafts position by position (i = 1..K). At each position every
still-open sequence asks the enabled proposers, in registry priority order, for
d_i; the first proposal wins. Proposing per position is what lets cheap
proposers (grammar-forced, n-gram) fill some positions and the draft model the
rest, and what lets draft-side masks use the grammar state after d_1..d_{i-1}.

A proposer with work that needs no mask (a model forward) splits it out into
``prepare``: the step runs it while the position's mask request is in flight,
and ``propose`` finishes from the prepared result once the mask row is known.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from specmask.gpu_worker.mask_table import DeviceMaskTable
    from specmask.gpu_worker.model_runner import ModelRunner
    from specmask.gpu_worker.sequence import SequenceState
    from specmask.kernels.backend import Backend
    from specmask.mask_service.client.row_table import MaskRow


@dataclass(frozen=True)
class Proposal:
    token_id: int
    # [V] float32: the normalised distribution d_i was drawn from (after any draft
    # mask, temperature, top-k/top-p). None = no distribution: q = 1 at token_id
    # (one-hot), which kernels.rejection_sample treats exactly like a one-hot row.
    q: torch.Tensor | None = None


@dataclass
class DeviceDrafts:
    """A batch's drafts sampled by the device draft loop (drafting.py), kept on the device.

    Row i holds the drafts of the i-th slot the loop ran, d_1..d_{k_i} in columns 0..k_i - 1
    (columns past k_i: never read). They reach the next draft forward and the verify forward as
    device tensors (model_runner.DeviceTail) and the rejection sampler by index
    (verifier.verify); the host sees them only if a mask request needs them (``read``), once."""

    tokens: torch.Tensor  # [n, K] int64
    # [n, K, V] float32 q rows (the distribution each draft was drawn from); None when every row
    # is greedy (q is then one-hot at the draft, which the sampler takes from the tokens).
    probs: torch.Tensor | None
    _host: list[list[int]] | None = None

    def read(self) -> list[list[int]]:
        """The tokens on the host ([n, K]): one batched read, the first time only."""
        if self._host is None:
            from specmask.gpu_worker.verifier import to_host

            self._host = to_host(self.tokens)
        return self._host


@dataclass(eq=False)
class DraftSlot:
    """One sequence's drafts under construction during this step's proposal phase (compared
    and hashed by identity: the drafter keeps sets of slots)."""

    seq: SequenceState
    k: int  # k_r: the most drafts this sequence may get this step
    drafts: list[int] = field(default_factory=list)  # d_1..d_i so far
    q_rows: list[torch.Tensor | None] = field(default_factory=list)  # per draft: [V] float32 or None (one-hot)
    # Per draft: where it came from (a proposer name, or FORCED_CONTINUATION), for the
    # verify-width choice's per-source acceptance (gpu_worker.verify_width).
    sources: list[str] = field(default_factory=list)
    # Grammar mask for the position being proposed, after d_1..d_{i-1}: a slot of the
    # mask client's interned table (with its allowed count); None when this sequence
    # has no grammar or no proposer asked for masks.
    mask_row: MaskRow | None = None
    # Every row the draft-side mask requests returned, in order: row j is M_j, the
    # mask after d_1..d_j. The verify path reuses them rather than ask again.
    grammar_rows: list[MaskRow] = field(default_factory=list)
    # The row for the next position, already known when this one ends (the row after a
    # forced run came with the run): that position then sends no request of its own.
    next_row: MaskRow | None = None
    # Proposer.prepare results for the position being proposed, keyed by proposer
    # name (e.g. the draft model's [V] float32 logits); cleared after each position.
    prepared: dict[str, Any] = field(default_factory=dict)
    open: bool = True  # False once drafting stopped for this sequence this step
    # What the slot's draft-side mask request in flight carries (drafting.py): the drafts it
    # held when the request went out, and the n-gram lookahead sent after them.
    sent: tuple[int, list[int]] | None = None
    # The next request goes without a lookahead: the last one's was refused where no forced
    # run was asked for (drafting.py ``_walk``).
    plain_next: bool = False
    # Drafts the device draft loop sampled: row ``device_row`` of ``device`` holds them, and
    # ``drafts``/``q_rows`` stay empty until ``read_device`` (``sources`` counts them).
    device: DeviceDrafts | None = None
    device_row: int = 0

    @property
    def num_drafts(self) -> int:
        """Drafts held, on the host or on the device."""
        return len(self.sources)

    def context(self) -> list[int]:
        """Committed tokens followed by the drafts so far (on the host: ``read_device`` first
        for a slot whose drafts are on the device)."""
        if self.device is not None and len(self.drafts) != self.num_drafts:
            raise RuntimeError(f"seq {self.seq.seq_id}: its drafts are on the device; read them first")
        return self.seq.token_ids + self.drafts

    def add(self, proposal: Proposal, source: str = "") -> None:
        if self.device is not None:
            raise RuntimeError(f"seq {self.seq.seq_id}: a host draft after device drafts")
        self.drafts.append(proposal.token_id)
        self.q_rows.append(proposal.q)
        self.sources.append(source)

    def read_device(self) -> None:
        """Bring this slot's device drafts to ``drafts`` (their q rows stay on the device)."""
        if self.device is not None and len(self.drafts) != self.num_drafts:
            self.drafts = self.device.read()[self.device_row][: self.num_drafts]

    def trim(self, keep: int) -> int:
        """Keep the first ``keep`` drafts (and the mask rows M_0..M_keep); returns how many went."""
        dropped = self.num_drafts - keep
        if dropped <= 0:
            return 0
        del self.drafts[keep:], self.q_rows[keep:], self.sources[keep:]
        del self.grammar_rows[keep + 1 :]  # rows past M_keep are for dropped drafts
        return dropped


@dataclass(frozen=True)
class ProposerResources:
    """What a worker can lend to proposers."""

    vocab_size: int  # V: target logits width; every q row has this width
    draft_runner: ModelRunner | None  # None = worker has no draft model
    ngram_min: int
    ngram_max: int
    kernel_backend: Backend | None = None  # None = resolve by device
    mask_table: DeviceMaskTable | None = None  # device mirror of the mask rows (None: a private one)


class Proposer(ABC):
    """Proposes d_i for a batch of slots at one draft position."""

    name: ClassVar[str]
    # Lower runs first. Cheap, certain sources go before the draft model so its
    # forward is skipped at positions they fill (where their inputs, e.g. the
    # mask row, are known before the forward would start).
    priority: ClassVar[int]
    # True if this proposer needs DraftSlot.mask_row at every position (the step
    # then fetches masks for grammar sequences that enable it).
    needs_masks: ClassVar[bool] = False
    # True if prepare() does work: the step then calls it for every slot that may
    # reach this proposer, before the position's masks arrive.
    prepares: ClassVar[bool] = False

    @classmethod
    def create(cls, resources: ProposerResources) -> Proposer | None:
        """Build from worker resources; None when the worker cannot run this proposer."""
        return cls()

    @abstractmethod
    def propose(self, slots: Sequence[DraftSlot], position: int) -> list[Proposal | None]:
        """Propose d_position (1-based) for each slot; None leaves the slot to the next proposer."""

    def foresees(self, slot: DraftSlot) -> bool:
        """Whether ``propose`` is expected to fill ``slot`` at this position, judged before its
        mask row is known (``slot.mask_row`` may be None). A preparing proposer later in the
        order then skips its work for the slot (the draft model's forward); if the guess fails
        once the row arrives, that proposer is asked anyway and prepares on demand. Only a
        guess about cost: a wrong one never changes which proposal wins."""
        return False

    def prepare(self, slots: Sequence[DraftSlot], position: int) -> None:  # noqa: B027 - optional hook
        """Optional first half of ``propose`` that must not read ``slot.mask_row``:
        store per-slot results in ``slot.prepared[self.name]``. ``propose`` must give
        the same proposals whether or not this ran first (up to float rounding of a
        differently batched forward), and must not rely on every slot being prepared."""
