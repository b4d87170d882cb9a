"""Draft-model proposals: one batched draft forward per draft position.

Each slot feeds the draft model the tokens its draft cache has not seen yet
(usually one; more after grammar-forced or n-gram positions, which skip the
draft forward, or after a step with k_r = 0), so the cache always catches up
exactly. With ``SpeculationParams.draft_masking`` the logits are masked with the
grammar state after d_1..d_{i-1} before sampling, and q is then the masked,
renormalised draft distribution (docs/design.md step 1). Greedy requests take the
argmax and return no q (one-hot).

The forward needs only d_1..d_{i-1}, like the mask request for position i, so it
is ``prepare`` (run while that request is in flight); ``propose`` masks and
samples, forwarding any slot that was not prepared.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmask.gpu_worker.mask_table import DeviceMaskTable
from specmask.gpu_worker.model_runner import ForwardItem, ModelRunner
from specmask.gpu_worker.proposers.base import DraftSlot, Proposal, Proposer, ProposerResources
from specmask.gpu_worker.proposers.registry import register
from specmask.kernels.backend import Backend


@register
class DraftModelProposer(Proposer):
    name = "draft_model"
    priority = 20  # the expensive fallback: only positions nobody else filled
    prepares = True  # the forward overlaps the position's mask request

    def __init__(
        self,
        runner: ModelRunner,
        vocab_size: int,
        kernel_backend: Backend | None = None,
        mask_table: DeviceMaskTable | None = None,
    ) -> None:
        self.runner = runner
        self.vocab_size = vocab_size  # V: target width; q rows and masks are sized to it
        self.kernel_backend = kernel_backend
        # Mask rows as ids into the worker's device-resident row table (shared with the verifier).
        self.mask_table = mask_table if mask_table is not None else DeviceMaskTable(runner.device)

    @classmethod
    def create(cls, resources: ProposerResources) -> DraftModelProposer | None:
        if resources.draft_runner is None:
            return None
        return cls(resources.draft_runner, resources.vocab_size, resources.kernel_backend, resources.mask_table)

    def _fit_width(self, logits: torch.Tensor) -> torch.Tensor:  # [n, V_draft] -> [n, V]
        """Align draft logits to the target width: a draft scoring a subset of the vocabulary
        (``ModelRunner.output_ids``) has its columns scattered to their ids and -inf elsewhere, so
        it never proposes a token outside it; a narrower draft gets -inf columns, a wider one
        loses tokens the target cannot emit."""
        ids = self.runner.output_ids  # checked against the target's vocabulary at load (read_draft_vocab)
        if ids is not None:
            full = torch.full((logits.shape[0], self.vocab_size), float("-inf"), device=logits.device)
            full[:, ids] = logits
            return full
        width = logits.shape[1]
        if width == self.vocab_size:
            return logits
        if width > self.vocab_size:
            return logits[:, : self.vocab_size].contiguous()
        pad = torch.full((logits.shape[0], self.vocab_size - width), float("-inf"), device=logits.device)
        return torch.cat([logits, pad], dim=1)

    def prepare(self, slots: Sequence[DraftSlot], position: int) -> None:
        """One batched draft forward; stores each slot's [V] float32 logits for this position."""
        if not slots:
            return
        items = []
        for slot in slots:
            kv = slot.seq.draft_kv
            if kv is None:
                raise RuntimeError(f"seq {slot.seq.seq_id}: draft_model enabled without a draft cache")
            items.append(ForwardItem(kv, slot.context()[kv.length :], num_logits=1))
        logits = self._fit_width(torch.cat(self.runner.forward(items), dim=0))  # [n, V] float32
        for slot, row in zip(slots, logits):
            slot.prepared[self.name] = row  # [V] float32

    def propose(self, slots: Sequence[DraftSlot], position: int) -> list[Proposal | None]:
        from specmask.kernels.bitmask import apply_token_bitmask_indirect_inplace
        from specmask.kernels.draft_sampling import sample_draft
        from specmask.kernels.sampling_params import SamplingTensors

        if not slots:
            return []
        self.prepare([s for s in slots if self.name not in s.prepared], position)
        # A fresh [n, V] tensor: masking below writes into it, never into prepared rows.
        logits = torch.stack([s.prepared.pop(self.name) for s in slots])  # [n, V] float32

        rows = [s.mask_row if s.seq.request.speculation.draft_masking else None for s in slots]
        if any(row is not None for row in rows):
            table, row_ids = self.mask_table.resolve(rows)  # [num_table_rows, W] int32, [n] int32
            apply_token_bitmask_indirect_inplace(logits, table, row_ids, backend=self.kernel_backend)
        # min_tokens: the target removes stop tokens at this output position, so q does too.
        suppressed = [i for i, s in enumerate(slots) if s.seq.stop_suppressed(len(s.drafts) + 1) > len(s.drafts)]
        if suppressed:
            from specmask.kernels.stop_suppression import suppress_stop_tokens_

            suppress_stop_tokens_(logits, suppressed, [slots[i].seq.min_tokens_stop_ids for i in suppressed])

        params = [s.seq.request.sampling for s in slots]
        seeds = [s.seq.seed for s in slots]
        steps = [s.seq.step for s in slots]
        sampling = SamplingTensors.from_lists(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            seeds=seeds,
            step=steps,
            device=logits.device,
            min_p=[p.min_p for p in params],
        )
        # The host already holds what the sampler would read back (greedy rows, seeds, steps):
        # the only read of this position is the tokens' below.
        tokens, probs = sample_draft(
            logits,
            sampling,
            position=position,
            backend=self.kernel_backend,
            greedy_host=[p.temperature == 0.0 for p in params],
            host_seeds=seeds,
            host_steps=steps,
        )
        # A row with no finite logit left (a draft vocabulary holding none of the tokens the grammar
        # allows here) proposes nothing: its sample would be a token the target must reject.
        live = torch.isfinite(logits.amax(dim=1))  # [n] bool
        tokens_host, live_host = torch.stack([tokens, live.to(tokens.dtype)]).tolist()
        return [
            Proposal(tok, None if p.temperature == 0.0 else probs[i]) if ok else None
            for i, (tok, ok, p) in enumerate(zip(tokens_host, live_host, params))
        ]
