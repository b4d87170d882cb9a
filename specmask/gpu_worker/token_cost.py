"""What a token costs a forward, counted in tokens: the unit of the iteration budget.

A forward's compute is its linear layers (the same for every token) plus its attention
(growing with the keys each token attends over). A token at position ``p`` attends over
``p + 1`` keys, so it costs

    1 + (p + 1) / K

"budget tokens", where ``K`` (``keys_per_token``) is the number of keys whose attention
costs as much as one token's linear layers. Counting FLOPs per layer: the linear layers
take 2 x (their parameters) per token; attention takes 4 x H_q x D per key (QK^T and PV,
a multiply-add each), so

    K = linear parameters per layer / (2 x H_q x D).

SmolLM2-135M: 106 M linear parameters over 30 layers, H_q x D = 576, K ~ 3,070. A
4,000-token prompt's next tokens cost ~2.3 each; a decode row at 300 tokens, ~1.1. On
the dev box's CPU the attention share measured a little above the FLOP count (flash
attention runs below the matmuls' FLOP rate), close enough to size chunks by. A model
with tens of thousands of keys per token (8B-class) counts almost one per token at any
context in use.

The budget counts this cost, not bare tokens: without it a prompt chunk's time grows with
its prompt's length at a fixed token count, and a stream beside a burst of long prompts
slows by the prompts' length (docs/scheduling.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TokenCost:
    """The cost model of one model's forwards (see the module doc)."""

    keys_per_token: float  # K: attention keys costing one token's linear layers; inf = tokens only

    def span(self, start: int, count: int) -> float:
        """Budget tokens of feeding ``count`` tokens at positions ``start .. start + count - 1``."""
        if count <= 0:
            return 0.0
        keys = count * start + count * (count + 1) / 2  # Σ (p + 1) over the positions
        return count + keys / self.keys_per_token

    def fit(self, start: int, budget: float, most: int) -> int:
        """The most tokens (at most ``most``) fed from position ``start`` whose ``span`` fits
        ``budget``; 0 when not even one does."""
        if most <= 0 or self.span(start, 1) > budget:
            return 0
        if self.span(start, most) <= budget:
            return most
        # span is increasing in count: c^2/(2K) + c(1 + (start + 1/2)/K) - budget = 0.
        a = 1 / (2 * self.keys_per_token)
        b = 1 + (start + 0.5) / self.keys_per_token
        count = int(budget / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
        count = max(1, min(count, most))
        while count > 1 and self.span(start, count) > budget:  # float rounding at the edge
            count -= 1
        while count < most and self.span(start, count + 1) <= budget:
            count += 1
        return count

    @classmethod
    def of_model(cls, model: Any) -> TokenCost:
        """The cost model of a transformers causal LM, from its config and parameter count."""
        config = model.config.get_text_config(decoder=True)
        layers = int(config.num_hidden_layers)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        query_width = int(config.num_attention_heads) * head_dim  # H_q x D
        total = sum(p.numel() for p in model.base_model.parameters())
        embeddings = model.get_input_embeddings()
        linear = total - (embeddings.weight.numel() if embeddings is not None else 0)
        per_layer = linear / max(1, layers)
        if per_layer <= 0 or query_width <= 0:
            return cls(math.inf)
        return cls(per_layer / (2 * query_width))
