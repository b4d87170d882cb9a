"""Forward passes of one causal LM over many sequences with per-sequence KV caches.

Batching strategy (``batched=True``): the sequences' caches are left-padded into
one ``[B, num_kv_heads, L_max, head_dim]`` cache per layer, the new tokens are
right-padded into ``[B, T_max]``, and a 2-D attention mask hides both paddings:

    row r:  [ pad (L_max - L_r) | past L_r | new T_r | pad (T_max - T_r) ]

Position ids are ``L_r + arange(T_max)`` (consecutive per row, so transformers
never mistakes the batch for packed sequences). Every real query sees only its
own real keys, at its true positions, so results match per-sequence forwards up
to float rounding (tests/gpu_worker/test_model_runner.py checks float32
closeness). Right-padding queries always have a real token before them, so no
attention row is fully masked (that would give NaN rows in SDPA).

After the forward each sequence's new keys/values (columns L_max .. L_max+T_r)
are appended to its own cache. ``batched=False`` runs one forward per sequence
with no padding at all; it is the reference for the batched path.

Logits are computed only for the rows asked for (``num_logits`` trailing rows
per sequence): prefill asks for none, so the ``[T, V]`` projection of a long
prompt is never materialised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.kv_cache import SequenceKV

# Token id written into padding slots. Any valid id works: padded queries'
# outputs are discarded and padded keys are masked out.
_PAD_TOKEN_ID = 0


@dataclass(frozen=True)
class ForwardItem:
    """One sequence's part of a forward."""

    kv: SequenceKV  # appended to in place
    token_ids: Sequence[int]  # [T_r] tokens at positions kv.length .. kv.length + T_r - 1; T_r >= 1
    num_logits: int  # logits are returned for the last num_logits of token_ids (0..T_r)


class ModelRunner:
    """Owns one loaded causal LM and runs padded batch forwards over per-sequence caches."""

    def __init__(self, model: Any, *, batched: bool = True, name: str = "model") -> None:
        self.model = model
        self.name = name
        self.batched = batched
        config = model.config.get_text_config(decoder=True)
        self._decoder = model.base_model  # hidden states, no vocabulary projection
        self._lm_head = model.get_output_embeddings()
        # Gemma-2-style models squash logits; keep parity with the model's own forward.
        self._softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.vocab_size: int = int(self._lm_head.weight.shape[0])  # V: logits width
        self.max_model_len: int = int(getattr(config, "max_position_embeddings", 1 << 30))
        self.device: torch.device = next(model.parameters()).device
        # Counters for benchmarks and metrics: batched forwards run, token positions computed.
        self.num_forwards = 0
        self.num_positions = 0

    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        """Append each item's tokens to its cache; return per item logits [num_logits, V] float32."""
        if not items:
            return []
        for it in items:
            if len(it.token_ids) == 0 or not 0 <= it.num_logits <= len(it.token_ids):
                raise ValueError(f"bad forward item: {len(it.token_ids)} tokens, {it.num_logits} logits")
            if it.kv.length + len(it.token_ids) > self.max_model_len:
                raise ValueError(
                    f"{self.name}: {it.kv.length + len(it.token_ids)} positions exceed max length {self.max_model_len}"
                )
        if self.batched and len(items) > 1:
            hidden = self._forward_padded(items)
            self.num_forwards += 1
        else:
            hidden = [self._forward_one(it) for it in items]
            self.num_forwards += len(items)
        self.num_positions += sum(len(it.token_ids) for it in items)
        return self._project(hidden)

    def _forward_one(self, item: ForwardItem) -> torch.Tensor:  # -> [num_logits, hidden]
        from transformers import DynamicCache

        past_len = item.kv.length
        num_new = len(item.token_ids)
        cache = DynamicCache(ddp_cache_data=list(zip(item.kv.keys, item.kv.values))) if past_len else DynamicCache()
        input_ids = torch.tensor([list(item.token_ids)], dtype=torch.long, device=self.device)  # [1, T]
        position_ids = torch.arange(past_len, past_len + num_new, device=self.device).unsqueeze(0)  # [1, T]
        out = self._decoder(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
        # DynamicLayer.update concatenated old and new entries into fresh tensors.
        item.kv.set([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])
        return out.last_hidden_state[0, num_new - item.num_logits :]  # [num_logits, hidden]

    def _forward_padded(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        from transformers import DynamicCache

        batch = len(items)
        past_lens = [it.kv.length for it in items]
        new_lens = [len(it.token_ids) for it in items]
        max_past, max_new = max(past_lens), max(new_lens)
        dev = self.device

        input_ids = torch.full((batch, max_new), _PAD_TOKEN_ID, dtype=torch.long, device=dev)  # [B, T_max]
        attention_mask = torch.zeros(batch, max_past + max_new, dtype=torch.long, device=dev)  # [B, L_max+T_max]
        for r, it in enumerate(items):
            input_ids[r, : new_lens[r]] = torch.tensor(list(it.token_ids), dtype=torch.long, device=dev)
            attention_mask[r, max_past - past_lens[r] : max_past + new_lens[r]] = 1
        position_ids = torch.tensor(past_lens, device=dev).unsqueeze(1) + torch.arange(
            max_new, device=dev
        )  # [B, T_max]

        cache = DynamicCache()
        if max_past > 0:
            template = next(it.kv for it in items if it.kv.length > 0)
            layers = []
            for layer in range(len(template.keys)):
                _, heads, _, head_dim = template.keys[layer].shape
                dtype = template.keys[layer].dtype
                k = torch.zeros(batch, heads, max_past, head_dim, dtype=dtype, device=dev)  # [B, H, L_max, D]
                v = torch.zeros_like(k)  # [B, H, L_max, D]
                for r, it in enumerate(items):
                    if past_lens[r]:
                        k[r, :, max_past - past_lens[r] :] = it.kv.keys[layer][0]
                        v[r, :, max_past - past_lens[r] :] = it.kv.values[layer][0]
                layers.append((k, v))
            cache = DynamicCache(ddp_cache_data=layers)

        out = self._decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state  # [B, T_max, hidden]
        results = []
        for r, it in enumerate(items):
            new_slice = slice(max_past, max_past + new_lens[r])
            keys, values = [], []
            for layer_idx, layer in enumerate(cache.layers):
                new_k = layer.keys[r : r + 1, :, new_slice]  # [1, H, T_r, D]
                new_v = layer.values[r : r + 1, :, new_slice]  # [1, H, T_r, D]
                if past_lens[r]:
                    keys.append(torch.cat([it.kv.keys[layer_idx], new_k], dim=2))
                    values.append(torch.cat([it.kv.values[layer_idx], new_v], dim=2))
                else:
                    # Copy so the sequence does not pin the whole batched tensor.
                    keys.append(new_k.clone(memory_format=torch.contiguous_format))
                    values.append(new_v.clone(memory_format=torch.contiguous_format))
            it.kv.set(keys, values)
            results.append(hidden[r, new_lens[r] - it.num_logits : new_lens[r]])  # [num_logits, hidden]
        return results

    def _project(self, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        """Vocabulary projection of only the requested rows, in one matmul."""
        counts = [h.shape[0] for h in hidden]
        if sum(counts) == 0:
            return [torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device) for _ in hidden]
        logits = self._lm_head(torch.cat(hidden, dim=0)).float()  # [Σ num_logits, V]
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return list(torch.split(logits, counts, dim=0))
