"""The iteration budget's cost model (gpu_worker.token_cost): a token at position p costs
1 + (p + 1) / K budget tokens, K from the model's shapes."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specmask.gpu_worker.token_cost import TokenCost


def _brute_span(cost: TokenCost, start: int, count: int) -> float:
    return sum(1 + (p + 1) / cost.keys_per_token for p in range(start, start + count))


@pytest.mark.parametrize("keys", [1.0, 37.5, 3073.0, 26_000.0])
def test_span_and_fit_agree_with_counting_token_by_token(keys: float) -> None:
    cost = TokenCost(keys)
    rng = random.Random(int(keys))
    for _ in range(300):
        start, most = rng.randrange(0, 9000), rng.randrange(0, 700)
        budget = rng.uniform(0, 900)
        count = rng.randrange(0, 50)
        assert cost.span(start, count) == pytest.approx(_brute_span(cost, start, count), rel=1e-9)
        fitted = cost.fit(start, budget, most)
        best = max((c for c in range(most + 1) if _brute_span(cost, start, c) <= budget + 1e-9), default=0)
        assert fitted == best, (start, budget, most)


def test_tokens_only_when_attention_is_free() -> None:
    cost = TokenCost(math.inf)
    assert cost.span(10_000, 64) == 64
    assert cost.fit(10_000, 64, 512) == 64


def test_late_chunks_of_a_long_prompt_get_fewer_tokens() -> None:
    cost = TokenCost(3073.0)
    assert cost.fit(0, 64, 512) == 63  # ~1 per token at the start of a prompt
    assert cost.fit(4000, 64, 512) == 27  # ~2.3 per token 4,000 tokens in
    assert cost.span(300, 1) == pytest.approx(1 + 301 / 3073)


def test_keys_per_token_from_a_real_shape() -> None:
    """SmolLM2-135M's shapes (built on the meta device: no weights): per layer q, o 576 x 576,
    k, v 576 x 192, the MLP 3 x 576 x 1536 and two norms, over 9 query heads of 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    expected = (per_layer + 576 / 30) / (2 * 576)  # the final norm shared out over the layers
    assert TokenCost.of_model(model).keys_per_token == pytest.approx(expected)
    assert 3000 < expected < 3100
