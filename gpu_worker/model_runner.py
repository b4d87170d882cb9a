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

The batch buffer has room for the new columns, and the cache layers write them
in place (``_in_place_cache``: transformers' ``DynamicLayer`` would concatenate,
copying the whole past of every layer once more). After the forward each
sequence's new keys/values (columns L_max .. L_max+T_r) are appended to its own
buffers (gpu_worker.kv_cache), so the one full copy per forward is the padding.
``batched=False`` runs one forward per sequence with no padding at all; it is
the reference for the batched path.

Logits are computed only for the rows asked for (``num_logits`` trailing rows
per sequence): prefill asks for none, so the ``[T, V]`` projection of a long
prompt is never materialised.
"""

from __future__ import annotations

import functools
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

        kv = item.kv
        past_len = kv.length
        num_new = len(item.token_ids)
        input_ids = torch.tensor([list(item.token_ids)], dtype=torch.long, device=self.device)  # [1, T]
        position_ids = torch.arange(past_len, past_len + num_new, device=self.device).unsqueeze(0)  # [1, T]
        in_place = kv.capacity > 0
        if not in_place:
            # First forward: transformers allocates; the entries are then copied in once.
            cache = DynamicCache()
        else:
            kv.reserve(num_new)
            k_bufs, v_bufs = kv.buffers()  # [1, H, capacity, D] per layer
            cache = _in_place_cache(k_bufs, v_bufs, filled=past_len)
        out = self._decoder(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
        if in_place:
            kv.advance(num_new)  # the layers wrote the new entries into kv's own buffers
        else:
            kv.append([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])
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

        if max_past == 0:
            cache: Any = DynamicCache()  # nothing cached yet: transformers allocates
        else:
            template = next(it.kv for it in items if it.kv.length > 0)
            t_keys, _ = template.buffers()
            # One batch buffer per layer holding the left-padded pasts, with room for the
            # new entries, which the cache layers write in place (no per-layer concat).
            _, heads, _, head_dim = t_keys[0].shape
            shape = (batch, heads, max_past + max_new, head_dim)
            k_bufs = [torch.zeros(shape, dtype=t_keys[0].dtype, device=dev) for _ in t_keys]  # [B, H, L+T, D]
            v_bufs = [torch.zeros_like(k) for k in k_bufs]  # [B, H, L+T, D]
            for r, it in enumerate(items):
                if past_lens[r]:
                    for k, v, src_k, src_v in zip(k_bufs, v_bufs, it.kv.keys, it.kv.values, strict=True):
                        k[r, :, max_past - past_lens[r] : max_past] = src_k[0]
                        v[r, :, max_past - past_lens[r] : max_past] = src_v[0]
            cache = _in_place_cache(k_bufs, v_bufs, filled=max_past)

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
            # Only this step's entries are copied into the sequence's own buffers.
            it.kv.append(
                [layer.keys[r : r + 1, :, new_slice] for layer in cache.layers],  # [1, H, T_r, D]
                [layer.values[r : r + 1, :, new_slice] for layer in cache.layers],  # [1, H, T_r, D]
            )
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


@functools.cache
def _in_place_layer_class() -> type:
    """``DynamicLayer`` whose ``update`` writes into a preallocated buffer (built lazily:
    transformers is imported only when a model runs)."""
    from transformers.cache_utils import DynamicLayer

    class InPlaceLayer(DynamicLayer):
        def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, filled: int) -> None:
            super().__init__()
            self._k_buf, self._v_buf = k_buf, v_buf  # [B, H, capacity, D]
            self.dtype, self.device = k_buf.dtype, k_buf.device
            self.keys, self.values = k_buf[:, :, :filled], v_buf[:, :, :filled]  # [B, H, filled, D] views
            self.is_initialized = True

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            start = self.keys.shape[-2]
            end = start + key_states.shape[-2]
            self._k_buf[:, :, start:end] = key_states  # [B, H, T, D]
            self._v_buf[:, :, start:end] = value_states
            self.keys, self.values = self._k_buf[:, :, :end], self._v_buf[:, :, :end]
            return self.keys, self.values

    return InPlaceLayer


def _in_place_cache(k_bufs: Sequence[torch.Tensor], v_bufs: Sequence[torch.Tensor], *, filled: int) -> Any:
    """A ``DynamicCache`` over preallocated per-layer buffers ``[B, H, capacity, D]`` whose first
    ``filled`` positions hold the past: the forward appends in place instead of concatenating
    (``DynamicLayer.update`` copies the whole past of every layer on every forward)."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache

    layer_class = _in_place_layer_class()
    cache = DynamicCache.__new__(DynamicCache)
    Cache.__init__(cache, layers=[layer_class(k, v, filled) for k, v in zip(k_bufs, v_bufs, strict=True)])
    return cache
