"""Forward passes of one causal LM over many sequences with slot KV caches.

Every sequence's keys/values live in one row of the model's ``SlotPool``
(gpu_worker.kv_cache): per layer ``[slots, H, capacity, D]``. A forward runs
over the contiguous range of pool rows its items occupy, attending straight
over those rows (a view: nobody's past is copied), and writes the new entries
into them in place (``_slot_cache``: one indexed write per layer).

**Packed** (the default for a batch): the decoder sees only the real new
tokens, all rows' concatenated into one ``[1, N]`` sequence, N = Σ T_r, with
each token's true position id. On a CPU the linear layers are most of a
forward's cost and scale with the positions they compute, so a verify batch of
rows 1..5 wide pays for Σ T_r positions, not R · T_max. Attention
still runs over the pool rows: each layer's cache write scatters the N new
keys/values to (slot, position), and the attention function
(gpu_worker.attention, told the layout through the ``packed_rows`` keyword)
runs each row's T_r queries over that row's own keys under its corner of the
mask below, so

    row r:  [ past L_r | new T_r ]   (nothing is written past L_r + T_r)

**Padded** (``packed=False``, kept as a reference): the new tokens are
right-padded into ``[R, T_max]`` and every layer computes all R · T_max
positions, including pool rows in the range that are not in the batch
("dummy rows"; the pool keeps used slots dense, so there are none when the
batch is everyone), whose writes land past their own length:

    row r:  [ past L_r | new T_r | (pad up to T_max: written past L_r + T_r, never read) ]

Either way a 4-D boolean mask ``[R, 1, T_max, end]`` lets query t of row r see
keys ``0 .. L_r + t`` of its own row, so every real query sees exactly its own
past and new tokens, at their true positions; results match a fresh forward up
to float rounding (tests/gpu_worker/test_model_runner.py checks float32
closeness). ``batched=False`` runs one forward per sequence (R = 1); it is the
reference for both batched paths.

Logits are computed only for the rows asked for (``num_logits`` trailing rows
per sequence): prefill asks for none, so the ``[T, V]`` projection of a long
prompt is never materialised.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specmask.gpu_worker.architecture import check as check_architecture
from specmask.gpu_worker.architecture import max_len, static_architecture
from specmask.gpu_worker.attention import ATTENTION, PackedRows, RowSpan, register
from specmask.gpu_worker.kv_cache import SequenceKV, SlotPool, kv_bytes_per_token
from specmask.gpu_worker.static_forward import StaticForward, place_tails
from specmask.gpu_worker.static_forward import build as build_static
from specmask.gpu_worker.token_cost import TokenCost

# Token id written into padding slots. Any valid id works: padded queries'
# outputs are discarded and padded keys are masked out.
_PAD_TOKEN_ID = 0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceTail:
    """Tokens of an item that stay on the device: ``tokens[row, start : start + count]``.

    The device draft loop (drafting.py) feeds its drafts to the next draft forward and to the
    verify forward this way, so they never come to the host in between."""

    tokens: torch.Tensor  # [n, K] int64 on the model's device, shared by every item of a batch
    row: int
    start: int
    count: int  # >= 1


@dataclass(frozen=True)
class ForwardItem:
    """One sequence's part of a forward."""

    kv: SequenceKV  # appended to in place
    token_ids: Sequence[int]  # host tokens at positions kv.length ..; the device tail (if any) follows them
    num_logits: int  # logits are returned for the last num_logits of the item's tokens (0..T_r)
    tail: DeviceTail | None = None  # tokens after token_ids that are on the device

    @property
    def length(self) -> int:
        """T_r: host tokens plus the device tail; T_r >= 1."""
        return len(self.token_ids) + (self.tail.count if self.tail is not None else 0)


class ModelRunner:
    """Owns one loaded causal LM and runs batch forwards (packed or padded) over per-sequence caches."""

    def __init__(
        self,
        model: Any,
        *,
        batched: bool = True,
        packed: bool = True,
        name: str = "model",
        static: str = "off",
        output_ids: torch.Tensor | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """``static``: the static-shape forward for decode and verify batches (gpu_worker.static_forward;
        "auto", "on" or "off", see ``static_forward.build``). Off by default here: the worker
        passes WorkerConfig.static_forward. ``output_ids``: the token id of each logit column when
        the LM head scores a subset of the vocabulary (loading.restrict_output_vocab); None when
        column j is token j. ``max_model_len``: the most positions a sequence may reach (None =
        the config's ``max_position_embeddings``). A configuration the worker does not implement
        raises ``architecture.UnsupportedModel``."""
        check_architecture(model.config, max_model_len, name=name)
        self.model = model
        self.name = name
        self.batched = batched
        self.packed = packed
        if batched and packed and model.config._attn_implementation != ATTENTION:
            # Only gpu_worker.attention reads the packed layout; any other attention
            # function would ignore it and attend with the [1, N] query as one row.
            model.set_attn_implementation(register())
            if model.config._attn_implementation != ATTENTION:
                raise ValueError(f"{name}: {type(model).__name__} cannot take the packed-forward attention function")
        config = model.config.get_text_config(decoder=True)
        self._decoder = model.base_model  # hidden states, no vocabulary projection
        self._lm_head = model.get_output_embeddings()
        # Gemma-2-style models squash logits; keep parity with the model's own forward.
        self._softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.vocab_size: int = int(self._lm_head.weight.shape[0])  # V: logits width
        if output_ids is not None and output_ids.shape != (self.vocab_size,):
            raise ValueError(f"{name}: {output_ids.shape[0]} output ids for an LM head of {self.vocab_size} rows")
        # Token ids the model can read: its input embedding's rows (the head may score fewer).
        self.input_vocab_size: int = int(model.get_input_embeddings().weight.shape[0])
        self.max_model_len: int = max_len(config, max_model_len)
        self.cost = TokenCost.of_model(model)  # what a token at a position costs a forward (the budget's unit)
        self.device: torch.device = next(model.parameters()).device
        # [V] int64 token ids of the logit columns, on the logits' device; None = column j is token j.
        self.output_ids = None if output_ids is None else output_ids.to(self.device)
        self.pool: SlotPool | None = None  # every sequence's KV for this model (built at the first forward)
        # The pool's byte budget (kv_cache.SlotPool.max_bytes), read when the pool is built; None =
        # unbounded (the worker sets none yet: docs/models.md, KV memory).
        self.kv_budget_bytes: int | None = None
        # Counters for benchmarks and metrics: batched forwards run, real token positions, and the
        # positions the linear layers computed (real + padding + dummy rows; equal when packed).
        self.num_forwards = 0
        self.num_positions = 0
        self.num_computed_positions = 0
        self.static: StaticForward | None = (
            build_static(model, static, self.max_model_len) if batched and packed else None
        )
        logger.info("%s: %s", name, self.describe_path())

    def describe_path(self) -> str:
        """The architecture and the forward path decode/verify batches take, and why (one line)."""
        arch = f"{type(self.model).__name__} ({getattr(self.model.config, 'model_type', '?')})"
        if self.static is not None:
            graphs = "CUDA graphs" if self.static.use_graphs else "eager, no graphs off CUDA"
            return f"{arch}: static forward ({graphs})"
        if not (self.batched and self.packed):
            return f"{arch}: eager {'padded' if self.batched else 'per-sequence'} forward (configured)"
        _, why = static_architecture(self.model, self.max_model_len)
        return f"{arch}: eager packed forward ({why or 'static forward off'})"

    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        """Append each item's tokens to its cache; return per item logits [num_logits, V] float32."""
        if not items:
            return []
        for it in items:
            if it.length == 0 or not 0 <= it.num_logits <= it.length:
                raise ValueError(f"bad forward item: {it.length} tokens, {it.num_logits} logits")
            if it.tail is not None and (it.tail.count < 1 or it.tail.tokens.device != self.device):
                raise ValueError(f"{self.name}: a device tail must hold tokens on {self.device}")
            if it.kv.length + it.length > self.max_model_len:
                raise ValueError(
                    f"{self.name}: {it.kv.length + it.length} positions exceed max length {self.max_model_len}"
                )
        static, plan = self.static, None
        if static is not None:
            pool = self._pool_for(items)  # binds new caches, so every item has its slot
            plan = static.plan(items)
        if static is not None and plan is not None:
            hidden = static.forward(pool, items, *plan)
            self.num_forwards += 1
            self.num_computed_positions += plan[0] * plan[1]
        elif self.batched and len(items) > 1:
            hidden = self._forward_packed(items) if self.packed else self._forward_padded(items)
            self.num_forwards += 1
        else:
            hidden = [h for it in items for h in self._forward_padded([it])]
            self.num_forwards += len(items)
        self.num_positions += sum(it.length for it in items)
        return self._project(hidden)

    def reserve(self, new_sequences: int, positions: int) -> None:
        """Grow the KV pool once for ``new_sequences`` more sequences of up to ``positions``
        positions (the worker's ``add``: see kv_cache on why one resize, not many)."""
        pool = self._pool()
        pool.grow(pool.num_used + new_sequences, min(positions, self.max_model_len))

    def _kv_shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) of this model's pool."""
        config = self.model.config.get_text_config(decoder=True)
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        return int(config.num_hidden_layers), heads, head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one position of one sequence takes in this model's pool."""
        return kv_bytes_per_token(*self._kv_shape(), next(self.model.parameters()).dtype)

    def _pool(self) -> SlotPool:
        if self.pool is None:
            param = next(self.model.parameters())
            self.pool = SlotPool(
                *self._kv_shape(), dtype=param.dtype, device=param.device, max_bytes=self.kv_budget_bytes
            )
        return self.pool

    def _pool_for(self, items: Sequence[ForwardItem]) -> SlotPool:
        pool = self._pool()
        for it in items:
            if it.kv.pool is None:
                pool.bind(it.kv)
            elif it.kv.pool is not pool:
                raise ValueError(f"{self.name}: a KV cache of another model was passed")
        return pool

    def _rows(self, items: Sequence[ForwardItem]) -> tuple[SlotPool, int, list[int]]:
        """The pool, the first pool row ``lo`` of the range [lo, hi) the items occupy, and every
        row's length (dummy rows: their owner's)."""
        pool = self._pool_for(items)
        lo = min(it.kv.pool_slot for it in items)
        hi = max(it.kv.pool_slot for it in items) + 1
        if len({it.kv.slot for it in items}) != len(items):
            raise ValueError(f"{self.name}: one KV cache appears twice in a forward")
        return pool, lo, [pool.owner(slot).length for slot in range(lo, hi)]

    def _forward_packed(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        """One forward over the real new tokens only (``[1, N]``); returns per item [num_logits, hidden]."""
        pool, lo, lengths = self._rows(items)
        dev = self.device
        rows, width = len(lengths), max(it.length for it in items)
        end = max(it.kv.length + it.length for it in items)  # keys the attention reads: 0..end-1
        pool.reserve(end)
        ids: list[int] = []
        row_of: list[int] = []  # [N] pool row (relative to lo) of each packed token
        pos_of: list[int] = []  # [N] its position in its sequence
        spans = []
        item_starts: list[int] = []  # [len(items)] where each item's tokens start in the packed row
        for it in items:
            n, r, past = it.length, it.kv.pool_slot - lo, it.kv.length
            spans.append(RowSpan(row=r, start=len(ids), count=n, keys=past + n))
            item_starts.append(len(ids))
            ids.extend(it.token_ids)
            ids.extend([_PAD_TOKEN_ID] * (n - len(it.token_ids)))  # the device tail's places
            row_of.extend([r] * n)
            pos_of.extend(range(past, past + n))
        input_ids = torch.tensor([ids], dtype=torch.long).to(dev, non_blocking=True)  # [1, N]
        place_tails(input_ids, items, [0] * len(items), item_starts)
        row_t = torch.tensor([row_of], dtype=torch.long).to(dev, non_blocking=True)  # [1, N]
        pos_t = torch.tensor([pos_of], dtype=torch.long).to(dev, non_blocking=True)  # [1, N]
        # Query t of row r sees keys 0 .. L_r + t. The attention reads only each row's own corner
        # [:T_r, :L_r + T_r] (gpu_worker.attention); dummy rows' and padding cells are never read.
        grid_pos = torch.tensor(lengths, dtype=torch.long).unsqueeze(1) + torch.arange(width)  # [R, T_max]
        grid_pos = grid_pos.to(dev, non_blocking=True)
        mask = torch.arange(end, device=dev).view(1, 1, end) <= grid_pos.unsqueeze(2)  # [R, T_max, end]

        hi = lo + rows
        cache = _slot_cache(
            [k[lo:hi] for k in pool.k],
            [v[lo:hi] for v in pool.v],
            rows=row_t,
            positions=pos_t,
            end=end,
            past=max(it.kv.length for it in items),
        )
        out = self._decoder(
            input_ids=input_ids,
            attention_mask=mask.unsqueeze(1),  # [R, 1, T_max, end]: returned unchanged by transformers' masking
            position_ids=pos_t,
            past_key_values=cache,
            use_cache=True,
            packed_rows=PackedRows(spans=tuple(spans), rows=rows),  # reaches gpu_worker.attention
        )
        hidden = out.last_hidden_state[0]  # [N, hidden]
        self.num_computed_positions += len(ids)
        results = []
        offset = 0
        for it in items:
            n = it.length
            it.kv.advance(n)  # the layers wrote its new entries into its own slot
            results.append(hidden[offset + n - it.num_logits : offset + n])  # [num_logits, hidden]
            offset += n
        return results

    def _forward_padded(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        """One forward over the pool rows ``items`` occupy, padded to ``[R, T_max]``; returns per item
        [num_logits, hidden]."""
        pool, lo, starts = self._rows(items)
        dev = self.device
        rows = len(starts)
        max_new = max(it.length for it in items)
        end = max(starts) + max_new  # keys the attention reads: positions 0..end-1
        pool.reserve(end)

        input_ids = torch.full((rows, max_new), _PAD_TOKEN_ID, dtype=torch.long)  # [R, T_max]
        for it in items:
            r = it.kv.pool_slot - lo
            input_ids[r, : len(it.token_ids)] = torch.as_tensor(list(it.token_ids), dtype=torch.long)
        input_ids = input_ids.to(dev, non_blocking=True)
        place_tails(input_ids, items, [it.kv.pool_slot - lo for it in items])
        start_t = torch.tensor(starts, dtype=torch.long).to(dev, non_blocking=True)  # [R]
        positions = start_t.unsqueeze(1) + torch.arange(max_new, device=dev)  # [R, T_max]
        # Query t of row r sees keys 0 .. L_r + t: its past and its own new tokens so far.
        mask = torch.arange(end, device=dev).view(1, 1, end) <= positions.unsqueeze(2)  # [R, T_max, end]

        hi = lo + rows
        row_t = torch.arange(rows, device=dev).unsqueeze(1)  # [R, 1]
        cache = _slot_cache(
            [k[lo:hi] for k in pool.k],
            [v[lo:hi] for v in pool.v],
            rows=row_t,
            positions=positions,
            end=end,
            past=max(starts),
        )
        out = self._decoder(
            input_ids=input_ids,
            attention_mask=mask.unsqueeze(1),  # [R, 1, T_max, end]
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state  # [R, T_max, hidden]
        self.num_computed_positions += rows * max_new
        results = []
        for it in items:
            r, n = it.kv.pool_slot - lo, it.length
            it.kv.advance(n)  # the layers wrote its new entries into its own slot
            results.append(hidden[r, n - it.num_logits : n])  # [num_logits, hidden]
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
def _slot_layer_class() -> type:
    """``DynamicLayer`` over pool rows: ``update`` writes each new entry at its (row, position)
    (one indexed write) and returns the rows' keys/values up to ``end`` (views).
    Built lazily: transformers is imported only when a model runs."""
    from transformers.cache_utils import DynamicLayer

    class SlotLayer(DynamicLayer):
        def __init__(
            self,
            k_rows: torch.Tensor,
            v_rows: torch.Tensor,
            rows: torch.Tensor,
            positions: torch.Tensor,
            end: int,
            past: int,
        ):
            super().__init__()
            self._k_rows, self._v_rows = k_rows, v_rows  # [R, H, capacity, D] views of the pool
            # Where new entry (b, t) of the layer's [B, H, T, D] input goes: row rows[b, t] (broadcast),
            # position positions[b, t]. Padded: [R, 1] and [R, T_max]; packed: [1, N] and [1, N].
            self._rows = rows
            self._positions = positions
            self._end = end
            self._past = past
            self.dtype, self.device = k_rows.dtype, k_rows.device
            self.keys, self.values = k_rows[:, :, :past], v_rows[:, :, :past]
            self.is_initialized = True

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            # [B, H, T, D] -> [B, T, H, D], the layout of rows[b, t], :, positions[b, t]
            self._k_rows[self._rows, :, self._positions] = key_states.transpose(1, 2)
            self._v_rows[self._rows, :, self._positions] = value_states.transpose(1, 2)
            self.keys, self.values = self._k_rows[:, :, : self._end], self._v_rows[:, :, : self._end]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self._past

    return SlotLayer


def _slot_cache(
    k_rows: Sequence[torch.Tensor],
    v_rows: Sequence[torch.Tensor],
    *,
    rows: torch.Tensor,
    positions: torch.Tensor,
    end: int,
    past: int,
) -> Any:
    """A ``DynamicCache`` whose layers write into and read from pool rows (see ``_slot_layer_class``)."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache

    layer_class = _slot_layer_class()
    cache = DynamicCache.__new__(DynamicCache)
    Cache.__init__(
        cache, layers=[layer_class(k, v, rows, positions, end, past) for k, v in zip(k_rows, v_rows, strict=True)]
    )
    return cache
