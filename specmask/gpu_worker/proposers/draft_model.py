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

Where no slot of a batch needs its mask row during proposal, ``draft_on_device``
runs the whole loop instead with the drafts kept on the device (drafting.py,
"The device draft loop").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from specmask.common.proposer_kind import ProposerKind
from specmask.gpu_worker.kv_cache import SequenceKV
from specmask.gpu_worker.mask_table import DeviceMaskTable
from specmask.gpu_worker.model_runner import DeviceTail, ForwardItem, ModelRunner
from specmask.gpu_worker.proposers.base import DeviceDrafts, DraftSlot, Proposal, Proposer, ProposerResources
from specmask.gpu_worker.proposers.registry import register
from specmask.gpu_worker.sampling_cache import SamplingCache, sampling_row
from specmask.gpu_worker.verifier import to_host
from specmask.kernels.backend import Backend
from specmask.kernels.sampling_params import SamplingTensors


@register
class DraftModelProposer(Proposer):
    name = ProposerKind.DRAFT_MODEL
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
        self.sampling = SamplingCache(runner.device)  # the rows' sampling parameters on the device

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
        sampling = self.sampling.tensors([sampling_row(p, seed) for p, seed in zip(params, seeds)], steps)
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
        # One batched copy (through a page-locked buffer and an event on a GPU: verifier.to_host).
        tokens_host, live_host = to_host(torch.stack([tokens, live.to(tokens.dtype)]))
        return [
            Proposal(tok, None if p.temperature == 0.0 else probs[i]) if ok else None
            for i, (tok, ok, p) in enumerate(zip(tokens_host, live_host, params))
        ]

    def draft_on_device(self, slots: Sequence[DraftSlot]) -> DeviceDrafts:
        """Every draft of ``slots`` (each ``k`` >= 1, none drafting with a mask row), sampled
        position by position with nothing read back: each position's tokens go into a
        [n, K] device tensor, from which the next draft forward takes its input
        (``DeviceTail``) and the verify forward and the sampler later take the drafts. Sets
        each slot's ``device``, ``device_row`` and ``sources``; returns the batch's drafts.

        Rows are ordered by k_r, largest first, so the rows still drafting at position i are a
        prefix (slices, not gathers). A row is not stopped at a stop token: verification cuts
        its output there (``SequenceState.commit``), and what the drafts after it do to the
        acceptance does not change what is kept. Greedy rows take the argmax; sampling rows
        draw with the same seeded noise streams as position-by-position proposal
        (``sample_draft``), and their q rows stay on the device for the rejection sampler."""
        from specmask.kernels.draft_sampling import sample_draft
        from specmask.kernels.stop_suppression import suppress_stop_tokens_

        rows = sorted(slots, key=lambda s: -s.k)  # stable: equal k keep the batch's order
        n, depth = len(rows), rows[0].k
        device = self.runner.device
        params = [s.seq.request.sampling for s in rows]
        greedy = [p.temperature == 0.0 for p in params]
        seeds = [s.seq.seed for s in rows]
        steps = [s.seq.step for s in rows]
        # Once for the step's loop (built once per batch composition); each position takes the
        # prefix of rows still drafting.
        sampling = self.sampling.tensors([sampling_row(p, seed) for p, seed in zip(params, seeds)], steps)
        tokens = torch.zeros(n, depth, dtype=torch.int64, device=device)  # [n, K]
        probs = None if all(greedy) else torch.zeros(n, depth, self.vocab_size, dtype=torch.float32, device=device)
        drafts = DeviceDrafts(tokens, probs)
        caches = [_draft_cache(s) for s in rows]
        for position in range(1, depth + 1):
            live = sum(1 for s in rows if s.k >= position)  # rows 0..live-1 draft d_position
            if position == 1:
                # What each draft cache has not seen yet (host tokens: committed ones).
                items = [ForwardItem(kv, s.context()[kv.length :], 1) for s, kv in zip(rows, caches)]
            else:  # d_{position-1}, straight from the device
                items = [
                    ForwardItem(kv, (), 1, DeviceTail(tokens, i, position - 2, 1)) for i, kv in enumerate(caches[:live])
                ]
            logits = self._fit_width(torch.cat(self.runner.forward(items), dim=0))[:live]  # [live, V] float32
            # min_tokens: the target removes stop tokens at this output position, so q does too.
            suppressed = [i for i in range(live) if rows[i].seq.stop_suppressed(position) > position - 1]
            if suppressed:
                suppress_stop_tokens_(logits, suppressed, [rows[i].seq.min_tokens_stop_ids for i in suppressed])
                # A row left with no finite logit (a draft vocabulary of stop tokens only) drafts
                # token 0 with q one-hot there: a proposal like any other, which the target
                # accepts only with its own probability of that token.
                dead = ~torch.isfinite(logits.amax(dim=1))  # [live] bool
                logits[:, 0] = torch.where(dead, torch.zeros_like(logits[:, 0]), logits[:, 0])
            tok, q = sample_draft(
                logits,
                sampling if live == n else _prefix(sampling, live),
                position=position,
                backend=self.kernel_backend,
                greedy_host=greedy[:live],
                host_seeds=seeds[:live],
                host_steps=steps[:live],
            )
            tokens[:live, position - 1] = tok
            if probs is not None:
                probs[:live, position - 1] = q
        for i, s in enumerate(rows):
            s.device, s.device_row = drafts, i
            s.sources = [self.name] * s.k
        return drafts


def _draft_cache(slot: DraftSlot) -> SequenceKV:
    kv = slot.seq.draft_kv
    if kv is None:
        raise RuntimeError(f"seq {slot.seq.seq_id}: draft_model enabled without a draft cache")
    return kv


def _prefix(sampling: SamplingTensors, rows: int) -> SamplingTensors:
    """The first ``rows`` requests' parameters (views)."""
    return dataclasses.replace(
        sampling,
        temperature=sampling.temperature[:rows],
        top_k=sampling.top_k[:rows],
        top_p=sampling.top_p[:rows],
        seeds=sampling.seeds[:rows],
        step=sampling.step[:rows],
        min_p=None if sampling.min_p is None else sampling.min_p[:rows],
    )
