"""specmask/gpu_worker/attention.py: masked GQA through SDPA's enable_gqa equals transformers' repeat-K/V path,
and a packed query laid out on the pool rows equals attending row by row."""

from __future__ import annotations

import pytest
import torch

from specmask.gpu_worker.attention import ATTENTION, PackedRows, RowSpan, gqa_sdpa_attention, register


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


def test_packed_query_matches_padded_grid_attention() -> None:
    """Rows of 2, 0 (a dummy row), 4 and 1 new tokens over different pasts, packed in the order
    3, 0, 2: equal to SDPA over the padded [R, T_max] grid with repeated K/V heads."""
    from transformers.integrations.sdpa_attention import repeat_kv

    g = torch.Generator().manual_seed(1)
    kv_heads, groups, s, d = 2, 3, 13, 8
    rows = 4
    k = torch.randn(rows, kv_heads, s, d, generator=g)  # [R, H_kv, S, D]
    v = torch.randn(rows, kv_heads, s, d, generator=g)
    pasts, news, order = [5, 7, 9, 11], [2, 0, 4, 1], [3, 0, 2]
    width = max(news)
    grid_q = torch.randn(rows, kv_heads * groups, width, d, generator=g)  # [R, H_q, T_max, D]
    grid_pos = torch.tensor(pasts).view(rows, 1) + torch.arange(width)  # [R, T_max]
    mask = (torch.arange(s).view(1, 1, s) <= grid_pos.unsqueeze(2)).unsqueeze(1)  # [R, 1, T_max, S]
    ref = torch.nn.functional.scaled_dot_product_attention(
        grid_q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=0.25
    ).transpose(1, 2)  # [R, T_max, H_q, D]
    spans, start = [], 0
    for r in order:
        spans.append(RowSpan(row=r, start=start, count=news[r], keys=pasts[r] + news[r]))
        start += news[r]
    q = torch.cat([grid_q[r : r + 1, :, : news[r]] for r in order], dim=2)  # [1, H_q, N, D]
    packed = PackedRows(spans=tuple(spans), rows=rows)
    got, _ = gqa_sdpa_attention(_Module(groups), q, k, v, mask, scaling=0.25, packed_rows=packed)
    assert got.shape == (1, start, kv_heads * groups, d)
    want = torch.cat([ref[r : r + 1, : news[r]] for r in order], dim=1)  # [1, N, H_q, D]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="packed attention needs"):
        gqa_sdpa_attention(_Module(groups), q, k[:2], v[:2], mask, packed_rows=packed)


def test_registered_with_transformers() -> None:
    from transformers import AttentionInterface

    assert register() == ATTENTION
    assert AttentionInterface()[ATTENTION] is gqa_sdpa_attention
