"""Exact rejection sampling for a ragged batch of speculative drafts (docs/design.md step 4).

Leviathan et al. 2023 (arXiv 2211.17192), Algorithm 1, per request r with
drafts d_1..d_k (k = k_r, possibly 0), draft distributions q_i and target
distributions p_i (processed by temperature / min-p / top-k / top-p, over logits that
are already grammar-masked):
* random request: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at
  the first rejection emit a *recovered* token ~ normalise(max(0, p_i - q_i));
  q = 1 at d_i when the proposer has no distribution (n-gram, grammar-forced),
  which makes the recovered token p_i with d_i removed;
* greedy request (temperature 0): accept while d_i == argmax(logits_i); the
  first mismatch emits that argmax;
* all k accepted: emit a *bonus* token from row k.
The emitted sequence is then distributed exactly as sequential sampling from
the masked target (greedy: identical to sequential argmax). A grammar-masked
token has p = 0, so a forbidden draft is always rejected and recovered/bonus
tokens are always allowed: every emitted token satisfies its position's mask.

That argument holds only while every stage is correct (a denormal
temperature made NaN probabilities emit EOS outside the mask). So, given the
mask rows, the accept stage also *checks* it: one bit read per emitted token
(accepted drafts, recovered, bonus, stop tokens alike). A request with an
emitted token its row forbids gets ``violation[r] = True``, no emitted tokens
(placeholders, ``num_emitted = 0``), and the caller must fail it loudly.

Layout (no padding anywhere): cu = cu_num_draft_tokens, drafts of request r
are draft_token_ids[cu[r-1]:cu[r]], its k_r + 1 target rows start at
cu[r-1] + r. Randomness comes from kernels.noise, drawn once outside the
kernels, so both backends produce identical tokens and a seeded request
replays exactly.

Pipeline: expand params to rows -> probabilities (kernels.probs) -> noise ->
recovered/bonus candidate per row (kernels.recovered) -> accept loop (this
module's kernel). Every stage runs on the resolved backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specmask.kernels.backend import Backend, resolve_backend
from specmask.kernels.noise import REJECTION_STREAM, draw_noise
from specmask.kernels.probs import logits_to_probs
from specmask.kernels.recovered import sample_recovered_tokens
from specmask.kernels.rejection_reference import PLACEHOLDER_TOKEN_ID
from specmask.kernels.sampling_params import SamplingTensors, expand_sampling_params

__all__ = ["PLACEHOLDER_TOKEN_ID", "HostLayout", "RejectionOutput", "rejection_sample"]


@dataclass(frozen=True)
class RejectionOutput:
    output_token_ids: torch.Tensor  # [B, K+1] int64; accepted drafts, then one recovered or
    #                                 bonus token, then PLACEHOLDER_TOKEN_ID
    num_emitted: torch.Tensor  # [B] int32, 1..k_r+1 (= num_accepted + 1)
    num_accepted: torch.Tensor  # [B] int32, 0..k_r (0 on a violation)
    backend: Backend  # which backend ran every stage
    violation: torch.Tensor  # [B] bool; True: an emitted token broke its mask row, nothing emitted


@dataclass(frozen=True)
class HostLayout:
    """The host-side facts of a batch that the sampler would otherwise read from the device."""

    num_drafts: Sequence[int]  # [B] k_r
    greedy: Sequence[bool]  # [B] temperature == 0
    seeds: Sequence[int] | None = None  # [B] SamplingTensors.seeds, for the noise generators
    steps: Sequence[int] | None = None  # [B] SamplingTensors.step


def _num_drafts(cu_host: Sequence[int]) -> list[int]:
    """k_r from the cumulative counts; raises unless they are non-decreasing."""
    out = [b - a for a, b in zip([0, *cu_host[:-1]], cu_host)]
    if any(k < 0 for k in out):
        raise ValueError(f"cu_num_draft_tokens {list(cu_host)} is not a cumulative count of the drafts")
    return out


def _check_inputs(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: SamplingTensors,
    mask_table: torch.Tensor | None,
    mask_row_ids: torch.Tensor | None,
) -> None:
    batch = cu_num_draft_tokens.shape[0] if cu_num_draft_tokens.dim() == 1 else -1
    if batch < 0 or sampling.batch_size != batch:
        raise ValueError(
            f"cu_num_draft_tokens must be [B] with B = {sampling.batch_size}, got {tuple(cu_num_draft_tokens.shape)}"
        )
    num_drafts = draft_token_ids.shape[0]
    if draft_token_ids.dim() != 1:
        raise ValueError(f"draft_token_ids must be [num_draft_tokens], got {tuple(draft_token_ids.shape)}")
    if target_logits.dim() != 2 or target_logits.shape[0] != num_drafts + batch:
        raise ValueError(
            f"target_logits must be [num_draft_tokens + B = {num_drafts + batch}, V], got {tuple(target_logits.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts, target_logits.shape[1]):
        raise ValueError(
            f"draft_probs must be [{num_drafts}, {target_logits.shape[1]}], got {tuple(draft_probs.shape)}"
        )
    if (mask_table is None) != (mask_row_ids is None):
        raise ValueError("mask_table and mask_row_ids go together")
    if mask_table is not None and mask_row_ids is not None:
        if mask_table.dim() != 2 or mask_table.dtype != torch.int32:
            raise ValueError(
                f"mask_table must be [num_table_rows, W] int32, got {mask_table.dtype} {tuple(mask_table.shape)}"
            )
        if tuple(mask_row_ids.shape) != (target_logits.shape[0],):
            raise ValueError(f"mask_row_ids must be [{target_logits.shape[0]}], got {tuple(mask_row_ids.shape)}")


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] int64
    cu_num_draft_tokens: torch.Tensor,  # [B] int32, cumulative k_r (k_r may be 0)
    draft_probs: torch.Tensor | None,  # [num_draft_tokens, V] float32; None => q = 1 everywhere
    target_logits: torch.Tensor,  # [num_tokens, V] float, ALREADY grammar-masked; not modified
    sampling: SamplingTensors,
    *,
    mask_table: torch.Tensor | None = None,  # [num_table_rows, W] int32 rows the logits were masked with
    mask_row_ids: torch.Tensor | None = None,  # [num_tokens] int32/int64 table row of each target row
    backend: Backend | None = None,
    host: HostLayout | None = None,
) -> RejectionOutput:
    """Verify a batch of drafts; see the module docstring for the algorithm and layout.

    With ``mask_table``/``mask_row_ids`` (the indirect layout of
    ``kernels.bitmask.apply_token_bitmask_indirect_inplace``), every emitted token is
    checked against its target row's mask (``RejectionOutput.violation``).

    ``host``: what the caller already knows on the host (k_r, which rows are greedy, seeds and
    steps): given, the sampler reads nothing back from the device before its results."""
    _check_inputs(draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, sampling, mask_table, mask_row_ids)
    ran = resolve_backend(backend, target_logits.device)
    device = target_logits.device
    num_tokens, vocab = target_logits.shape
    batch = sampling.batch_size

    if host is None:
        # Host syncs for the ragged layout (K sizes the output, k_r sizes the noise) and the
        # greedy rows: a caller that knows them passes ``host`` instead.
        host = HostLayout(
            num_drafts=_num_drafts(cu_num_draft_tokens.tolist()),
            greedy=(sampling.temperature == 0.0).tolist(),
        )
    num_drafts = list(host.num_drafts)  # [B] k_r
    if len(num_drafts) != batch or len(host.greedy) != batch or any(k < 0 for k in num_drafts):
        raise ValueError(f"host layout {host} does not fit a batch of {batch}")
    if sum(num_drafts) != draft_token_ids.shape[0]:
        raise ValueError(f"k_r {num_drafts} (cu_num_draft_tokens) is not a cumulative count of the drafts")
    max_num_drafts = max(num_drafts, default=0)
    greedy_host = list(host.greedy)

    rows, _ = expand_sampling_params(sampling, cu_num_draft_tokens, num_tokens, backend=ran)
    target_probs = None
    if not all(greedy_host):
        target_probs = logits_to_probs(target_logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p)
    uniforms, inv_exp_noise = draw_noise(
        sampling.seeds,
        sampling.step,
        REJECTION_STREAM,
        num_drafts,
        [not g for g in greedy_host],
        vocab,
        device,
        host_seeds=host.seeds,
        host_steps=host.steps,
    )
    recovered, _ = sample_recovered_tokens(
        target_logits,
        target_probs,
        draft_token_ids,
        draft_probs,
        cu_num_draft_tokens,
        rows.request_index,
        sampling.temperature,
        inv_exp_noise,
        backend=ran,
    )
    if ran is Backend.TRITON:
        from specmask.kernels import rejection_triton as impl
    else:
        from specmask.kernels import rejection_reference as impl  # type: ignore[no-redef]  # same functions
    output_token_ids, num_accepted, violation = impl.rejection_accept(
        draft_token_ids,
        cu_num_draft_tokens,
        draft_probs,
        target_probs,
        sampling.temperature,
        uniforms,
        recovered,
        max_num_drafts,
        mask_table,
        mask_row_ids,
    )
    return RejectionOutput(
        output_token_ids=output_token_ids,
        num_emitted=torch.where(violation, 0, num_accepted + 1).to(torch.int32),
        num_accepted=num_accepted,
        backend=ran,
        violation=violation,
    )
