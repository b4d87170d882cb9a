"""gpu_worker/attention.py: masked GQA through SDPA's enable_gqa equals transformers' repeat-K/V path,
and a packed query laid out on the pool rows equals attending row by row."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention import ATTENTION, PackedRows, gqa_sdpa_attention, register


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


def test_packed_query_matches_row_by_row_attention() -> None:
    """Rows of 2, 0 (a dummy row) and 4 new tokens over different pasts, packed in the order 2, 0."""
    from transformers.integrations.sdpa_attention import repeat_kv

    g = torch.Generator().manual_seed(1)
    kv_heads, groups, s, d = 2, 3, 13, 8
    k = torch.randn(3, kv_heads, s, d, generator=g)  # [R, H_kv, S, D]
    v = torch.randn(3, kv_heads, s, d, generator=g)
    pasts, news, order = [5, 7, 9], [2, 0, 4], [2, 0]
    width = max(news)
    n = sum(news)
    q = torch.randn(1, kv_heads * groups, n, d, generator=g)  # [1, H_q, N, D], rows in ``order``
    index = torch.tensor([r * width + t for r in order for t in range(news[r])])  # [N]
    grid_pos = torch.zeros(3 * width, dtype=torch.long)
    grid_pos[index] = torch.tensor([pasts[r] + t for r in order for t in range(news[r])])
    mask = (torch.arange(s).view(1, 1, s) <= grid_pos.view(3, width, 1)).unsqueeze(1)  # [R, 1, T_max, S]
    packed = PackedRows(index=index, rows=3, width=width)
    got, _ = gqa_sdpa_attention(_Module(groups), q, k, v, mask, scaling=0.25, packed_rows=packed)
    assert got.shape == (1, n, kv_heads * groups, d)
    offset = 0
    for r in order:
        t = news[r]
        row_q = q[:, :, offset : offset + t]  # [1, H_q, T_r, D]
        row_mask = torch.arange(s).view(1, s) <= (pasts[r] + torch.arange(t)).view(t, 1)  # [T_r, S]
        ref = torch.nn.functional.scaled_dot_product_attention(
            row_q, repeat_kv(k[r : r + 1], groups), repeat_kv(v[r : r + 1], groups), attn_mask=row_mask, scale=0.25
        ).transpose(1, 2)  # [1, T_r, H_q, D]
        torch.testing.assert_close(got[:, offset : offset + t], ref, rtol=1e-5, atol=1e-6)
        offset += t
    with pytest.raises(ValueError, match="packed attention needs"):
        gqa_sdpa_attention(_Module(groups), q, k[:2], v[:2], mask, packed_rows=packed)


def test_registered_with_transformers() -> None:
    from transformers import AttentionInterface

    assert register() == ATTENTION
    assert AttentionInterface()[ATTENTION] is gqa_sdpa_attention
