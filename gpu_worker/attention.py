"""Masked grouped-query attention without copying K/V per query head.

The worker's batched forward always passes an explicit 4-D mask (model_runner.py:
each pool row attends to its own past). For a GQA model (SmolLM2-135M: 9 query
heads over 3 KV heads) transformers' SDPA path then repeats K and V to every query
head whenever more than one query token is in flight (``repeat_kv``: a copy of the
whole past per layer), because it enables SDPA's native GQA only without a mask.
On CPU that copy dominated a verify forward: B = 9 rows over 1,200 cached tokens
took 136 ms for 1 token per row but 670 ms for 2 and 853 ms for 5 (62% of it
``aten::copy_``). Torch's SDPA takes ``enable_gqa`` with a mask on CPU (the
flash-attention CPU kernel): 127 / 180 / 273 ms for the same forwards.

``ATTENTION`` is registered with transformers' ``AttentionInterface`` when a model
is loaded (``register``), never at import. Without a mask, or without grouped
heads, it defers to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

ATTENTION = "specmask_sdpa_gqa"


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
    """Returns ([B, T, H_q, D], None), as transformers' attention functions do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1))
    if attention_mask is None or groups == 1 or kwargs.get("position_bias") is not None or kwargs.get("cache"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # [B, H_q, T, D]
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def register() -> str:
    """Register ``ATTENTION`` with transformers (once per process); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, gqa_sdpa_attention)
    return ATTENTION
