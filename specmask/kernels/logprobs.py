"""Log-probabilities of emitted tokens under the grammar-masked target distribution.

Definition (docs/openai-api.md "Logprobs"): for a target row with grammar-masked
logits ``l`` (``-inf`` where the mask forbids a token) and the request's
temperature ``T``,

    logprob(v) = log_softmax(l / T')[v],   T' = T if T > 0 else 1,

that is the distribution the sampler draws from *after* the grammar mask and the
temperature but *before* top-k / top-p truncation. Greedy rows (T = 0) use
T' = 1, so they get the model's own masked distribution instead of a degenerate
one-hot. Forbidden tokens get ``-inf``; the top-N list is taken over the same
row, so a forbidden token can only appear in it with ``-inf``, which callers drop.

One PyTorch implementation for every device (like ``kernels.probs``): a row
gather, ``log_softmax``, a gather at the emitted tokens and one ``topk``, run on
the logits' device over only the rows whose request asked for logprobs; the
results are ``[n]`` and ``[n, N]`` tensors, all a caller transfers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MAX_TOP_LOGPROBS", "RowLogprobs", "row_logprobs"]

# The most alternatives one position returns (OpenAI's top_logprobs bound).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class RowLogprobs:
    token_logprobs: torch.Tensor  # [n] float32: logprob of token_ids[i] in row i
    top_logprobs: torch.Tensor  # [n, N] float32, descending; -inf entries are forbidden tokens
    top_ids: torch.Tensor  # [n, N] int64


def row_logprobs(
    logits: torch.Tensor,  # [num_rows, V] float, grammar-masked (-inf = forbidden); not modified
    rows: torch.Tensor,  # [n] int64: the rows to score
    temperature: torch.Tensor,  # [n] float32 per scored row; 0 = greedy (scored at 1)
    token_ids: torch.Tensor,  # [n] int64: the emitted token of each scored row
    num_top: int,  # N, 0..MAX_TOP_LOGPROBS
) -> RowLogprobs:
    """Logprob of ``token_ids[i]`` and the ``num_top`` most likely tokens of row ``rows[i]``."""
    if not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"num_top must be in [0, {MAX_TOP_LOGPROBS}], got {num_top}")
    if not (rows.dim() == temperature.dim() == token_ids.dim() == 1) or not (
        rows.shape[0] == temperature.shape[0] == token_ids.shape[0]
    ):
        raise ValueError(
            f"rows {tuple(rows.shape)}, temperature {tuple(temperature.shape)} and token_ids "
            f"{tuple(token_ids.shape)} must be [n]"
        )
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))  # [n]
    scaled = logits.index_select(0, rows).float() / scale.unsqueeze(1)  # [n, V], a fresh tensor
    logp = torch.log_softmax(scaled, dim=-1)  # [n, V]
    token = logp.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [n]
    if num_top:
        top = logp.topk(min(num_top, logp.shape[1]), dim=-1)  # sorted, descending
        values, ids = top.values, top.indices
    else:
        values = logp.new_empty(rows.shape[0], 0)
        ids = torch.empty(rows.shape[0], 0, dtype=torch.int64, device=logp.device)
    return RowLogprobs(token_logprobs=token, top_logprobs=values, top_ids=ids)
