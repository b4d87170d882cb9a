"""Masked grouped-query attention without copying K/V per query head.

The worker's batched forward always passes an explicit 4-D mask (model_runner.py:
each pool row attends to its own past). For a GQA model (SmolLM2-135M: 9 query
heads over 3 KV heads) transformers' SDPA path then repeats K and V to every query
head whenever more than one query token is in flight (``repeat_kv``: a copy of the
whole past per layer), because it enables SDPA's native GQA only without a mask.
On CPU that copy dominated a verify forward as soon as rows were more than one
token wide (most of it ``aten::copy_``). Torch's SDPA takes ``enable_gqa`` with a
mask on CPU (the flash-attention CPU kernel), which avoids the copy.

Packed forwards (model_runner.py): the runner feeds the decoder only the real
new tokens of every row, concatenated as one ``[1, N]`` sequence, so the linear
layers compute N = Σ T_r positions instead of R · T_max. Attention still runs
over the pool rows: the runner passes the layout as the ``packed_rows`` keyword
(transformers forwards the decoder's extra keyword arguments through every
layer to the attention function), and this function runs one SDPA per row:
that row's T_r queries (a slice of the packed query) over its own first
L_r + T_r keys (a view of its pool row), under that row's corner of the
runner's ``[R, 1, T_max, end]`` mask (none for a one-token row, which sees all
of them). Per row, not on the padded ``[R, T_max]`` grid: attention reads every
row's K/V, so a wide grid and keys up to the batch's longest row cost more than
the per-call overhead, even when every row is one token wide.

``ATTENTION`` is registered with transformers' ``AttentionInterface`` when a model
is loaded (``register``), never at import. Without a mask, or without grouped
heads, an unpacked forward defers to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

ATTENTION = "specmask_sdpa_gqa"


@dataclass(frozen=True)
class RowSpan:
    """One row's run of tokens in a packed forward."""

    row: int  # its pool row, relative to the forward's first (index into key/value and mask)
    start: int  # where its tokens start among the N packed tokens
    count: int  # T_r >= 1
    keys: int  # L_r + T_r: the keys its last token sees


@dataclass(frozen=True)
class PackedRows:
    """The layout of a packed forward: its rows' runs of tokens, in packed order."""

    spans: tuple[RowSpan, ...]
    rows: int  # R: pool rows the forward attends over (dummy rows included)


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H_q, T, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,  # [B, H_kv, S, D]
    attention_mask: torch.Tensor | None,  # [B, 1, T, S] bool (True = attend) or additive float
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Returns ([B, T, H_q, D], None), as transformers' attention functions do.

    With ``packed_rows`` (a ``PackedRows``): B = 1 and T = N packed tokens, while
    ``key``/``value`` are ``[R, H_kv, S, D]`` pool rows and the mask is ``[R, 1, T_max, S]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1))
    packed = kwargs.pop("packed_rows", None)
    if packed is not None:
        return _packed_attention(packed, query, key, value, attention_mask, dropout, scaling, groups > 1), None
    if attention_mask is None or groups == 1 or kwargs.get("position_bias") is not None or kwargs.get("cache"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # [B, H_q, T, D]
    return out.transpose(1, 2).contiguous(), None


def _packed_attention(
    packed: PackedRows,
    query: torch.Tensor,  # [1, H_q, N, D]
    key: torch.Tensor,  # [R, H_kv, S, D]
    value: torch.Tensor,  # [R, H_kv, S, D]
    attention_mask: torch.Tensor | None,  # [R, 1, T_max, S] bool: query t of row r sees keys <= L_r + t
    dropout: float,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:  # [1, N, H_q, D]
    if attention_mask is None or attention_mask.ndim != 4 or query.shape[0] != 1 or key.shape[0] != packed.rows:
        raise ValueError(
            f"packed attention needs a [R, 1, T_max, S] mask over R={packed.rows} rows and a [1, H, N, D] query, "
            f"got query {tuple(query.shape)}, key {tuple(key.shape)}"
        )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    groups = heads // kv_heads  # G: query heads per KV head (head h reads KV head h // G, as repeat_kv)
    outs = []
    for span in packed.spans:
        r, t, s = span.row, span.count, span.keys
        q = query[:, :, span.start : span.start + t]  # [1, H_q, T_r, D]
        k = key[r : r + 1, :, :s]  # [1, H_kv, L_r + T_r, D]: a view of the pool row
        v = value[r : r + 1, :, :s]
        if t == 1 or not gqa:
            # A one-token row sees all of its keys: no mask (SDPA's cheaper path).
            mask = None if t == 1 else attention_mask[r : r + 1, :, :t, :s]  # [1, 1, T_r, L_r + T_r]
            outs.append(sdpa(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa))
            continue
        # Several queries under a mask with grouped heads: fold each KV head's G query heads into
        # its query axis ([1, H_kv, G·T_r, D], rows ordered (g, t)) and repeat the mask rows G
        # times, so SDPA sees as many query heads as KV heads. Torch's enable_gqa path was the
        # slower of the two on CPU for a few queries over a long past, and a verify forward
        # makes this call once per row per layer.
        mask = attention_mask[r : r + 1, :, :t, :s].repeat(1, 1, groups, 1)  # [1, 1, G·T_r, L_r + T_r]
        folded = q.reshape(1, kv_heads, groups * t, dim)  # [1, H_kv, G·T_r, D]
        out = sdpa(folded, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)  # [1, H_kv, G·T_r, D]
        outs.append(out.reshape(1, heads, t, dim))  # [1, H_q, T_r, D]; a CUDA SDPA output may be strided
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()  # [1, N, H_q, D]


@functools.cache
def register() -> str:
    """Register ``ATTENTION`` with transformers (once per process); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, gqa_sdpa_attention)
    return ATTENTION
