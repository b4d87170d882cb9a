"""gpu_worker/attention.py: masked GQA through SDPA's enable_gqa equals transformers' repeat-K/V path."""

from __future__ import annotations

import torch

from gpu_worker.attention import ATTENTION, gqa_sdpa_attention, register


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def test_masked_gqa_matches_repeated_heads() -> None:
    from transformers.integrations.sdpa_attention import repeat_kv

    g = torch.Generator().manual_seed(0)
    rows, kv_heads, groups, t, s, d = 3, 2, 3, 4, 11, 8
    q = torch.randn(rows, kv_heads * groups, t, d, generator=g)  # [B, H_q, T, D]
    k = torch.randn(rows, kv_heads, s, d, generator=g)  # [B, H_kv, S, D]
    v = torch.randn(rows, kv_heads, s, d, generator=g)
    lengths = torch.tensor([3, 7, 5])  # each row's past; query j sees keys < past + j + 1
    positions = lengths.view(rows, 1) + torch.arange(t)  # [B, T]
    mask = (torch.arange(s).view(1, 1, s) <= positions.unsqueeze(2)).unsqueeze(1)  # [B, 1, T, S] bool
    got, _ = gqa_sdpa_attention(_Module(groups), q, k, v, mask, scaling=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=0.3
    ).transpose(1, 2)
    assert got.shape == (rows, t, kv_heads * groups, d)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_registered_with_transformers() -> None:
    from transformers import AttentionInterface

    assert register() == ATTENTION
    assert AttentionInterface()[ATTENTION] is gqa_sdpa_attention
