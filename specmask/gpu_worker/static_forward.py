"""A static-shape decoder forward over the slot KV pool, replayed as a CUDA graph on a GPU.

Owns the bucketed layout (batch row b = pool slot b, every row T wide, keys read up to S,
inputs and outputs preallocated per (B, T, S)), the decoder it runs through the model's own
submodules (families: gpu_worker.architecture), and graph capture and replay on CUDA; on a
CPU the same function runs eagerly at the exact batch range. Forwards outside the buckets
run eagerly through model_runner.py. Why and how: docs/performance.md, "The static-shape
forward and CUDA graphs".
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from specmask.gpu_worker.architecture import static_architecture

if TYPE_CHECKING:
    from specmask.gpu_worker.kv_cache import SlotPool
    from specmask.gpu_worker.model_runner import ForwardItem


# Batch sizes a graph is captured for (a forward of B rows runs the smallest bucket >= B).
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# Tokens per row: 1 (a draft position), k + 1 (a verify forward), a few more (a draft
# catching up after a step that accepted everything). Wider forwards are prefill: eager.
WIDTH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16)
# Captured graphs kept (least recently used dropped first): each holds its buffers and
# a share of the graph memory pool.
MAX_GRAPHS = 96
# Key positions the pool grows by at least, on a GPU: every growth means new graphs.
GPU_CAPACITY_STEP = 1024
# Key positions attention reads, on a GPU: the batch's longest row rounded up to this, so a
# graph serves every step until the context crosses the next multiple (reading the whole
# capacity instead would multiply the KV bytes a step moves).
KEY_BUCKET = 256
# Failed captures (each then run eagerly) after which no new shape is captured.
MAX_CAPTURE_FAILURES = 3
# Token fed to rows and columns that carry no real token (any valid id works).
_PAD_TOKEN_ID = 0

logger = logging.getLogger(__name__)


def place_tails(
    ids: torch.Tensor,  # [R, T] int64 on the device: the forward's token grid, host tokens already in
    items: Sequence[ForwardItem],
    rows: Sequence[int],  # [len(items)] the grid row of each item
    starts: Sequence[int] | None = None,  # [len(items)] the grid column of each item's first token (None: 0)
) -> None:
    """Write every item's device tail into ``ids`` after its host tokens, in place: a handful of
    ops for the whole batch (one gather, one indexed write per distinct tail tensor), no read."""
    by_tensor: dict[int, tuple[torch.Tensor, list[int], list[int], list[int], list[int]]] = {}
    for i, it in enumerate(items):
        tail = it.tail
        if tail is None:
            continue
        entry = by_tensor.setdefault(id(tail.tokens), (tail.tokens, [], [], [], []))
        first = (0 if starts is None else starts[i]) + len(it.token_ids)
        entry[1].extend([rows[i]] * tail.count)
        entry[2].extend(range(first, first + tail.count))
        entry[3].extend([tail.row] * tail.count)
        entry[4].extend(range(tail.start, tail.start + tail.count))
    for tokens, dst_r, dst_c, src_r, src_c in by_tensor.values():
        index = torch.tensor([dst_r, dst_c, src_r, src_c], dtype=torch.long).to(ids.device, non_blocking=True)
        ids[index[0], index[1]] = tokens[index[2], index[3]]


def _bucket(n: int, buckets: Sequence[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def supports(model: torch.nn.Module, max_model_len: int | None = None) -> bool:
    """Whether ``model`` is a family this forward runs (gpu_worker.architecture), its sequences
    capped at ``max_model_len`` positions."""
    return static_architecture(model, max_model_len)[0] is not None


@dataclass
class _Buffers:
    """One shape's preallocated inputs and output (a captured graph reads and writes only these)."""

    input_ids: torch.Tensor  # [B, T] int64
    positions: torch.Tensor  # [B, T] int64: L_b + t
    hidden: torch.Tensor | None = None  # [B, T, hidden]: the decoder's output
    graph: torch.cuda.CUDAGraph | None = None


class StaticForward:
    """Runs a decoder of a family in gpu_worker.architecture over pool rows ``[0, B)`` at bucketed static shapes."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        use_graphs: bool | None = None,
        pad_to_buckets: bool | None = None,
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
        width_buckets: Sequence[int] = WIDTH_BUCKETS,
        max_model_len: int | None = None,
    ) -> None:
        """``use_graphs``: capture and replay CUDA graphs (None = on a CUDA device).
        ``pad_to_buckets``: run B and T at their buckets even without graphs (None = with graphs;
        tests pass True on a CPU to run the padded layout a graph would).
        ``max_model_len``: the positions the caller lets a sequence reach (a sliding window at
        least that wide is no obstacle); None = the config's."""
        arch, why = static_architecture(model, max_model_len)
        if arch is None:
            raise ValueError(f"{type(model).__name__}: no static forward for this model: {why}")
        self.arch = arch
        self.model = model
        # Hugging Face modules: their attributes exist at run time (supports() checked the layout),
        # and nn.Module's __getattr__ types them all as Tensor | Module.
        base: Any = model.model
        self._embed: Any = base.embed_tokens
        self._layers: list[Any] = list(base.layers)
        self._norm: Any = base.norm
        self._rotary: Any = base.rotary_emb
        first = self._layers[0].self_attn
        config: Any = model.config
        self._heads = int(config.num_attention_heads)
        self._kv_heads = int(getattr(config, "num_key_value_heads", None) or self._heads)
        self._head_dim = int(first.head_dim)
        self._scaling = float(first.scaling)
        self.device: torch.device = next(model.parameters()).device
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.pad_to_buckets = self.use_graphs if pad_to_buckets is None else pad_to_buckets
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.width_buckets = tuple(sorted(width_buckets))
        self._graphs: OrderedDict[tuple[int, ...], _Buffers] = OrderedDict()
        self._graph_pool: Any = None  # the captured graphs' shared memory pool (an opaque CUDA handle)
        self._pool_tensors: tuple[int, ...] = ()  # addresses of the KV tensors the graphs read
        # Counters (tests, benches).
        self.forwards = 0
        self.captures = 0
        self.replays = 0
        self.capture_failures = 0

    # -- shape planning -----------------------------------------------------------------------
    def plan(self, items: Sequence[ForwardItem]) -> tuple[int, int] | None:
        """(B, T) for ``items``, or None when they fall outside the buckets (run them eagerly)."""
        if any(it.num_logits == 0 for it in items):
            return None  # a prompt chunk riding along (actor.py): neither a decode nor a verify row
        slots = [it.kv.slot for it in items]
        if any(s is None for s in slots):
            return None  # a cache without a slot yet: the eager path binds it
        width = max(it.length for it in items)
        rows = max(s for s in slots if s is not None) + 1
        t = _bucket(width, self.width_buckets)
        b = _bucket(rows, self.batch_buckets)
        if t is None or b is None:
            return None
        return (b, t) if self.pad_to_buckets else (rows, width)

    # -- the forward ----------------------------------------------------------------------------
    def forward(self, pool: SlotPool, items: Sequence[ForwardItem], rows: int, width: int) -> list[torch.Tensor]:
        """Append every item's tokens to its slot; return per item its [num_logits, hidden] rows.

        ``rows``/``width`` come from ``plan``; every item's cache is bound to ``pool``."""
        if len({it.kv.slot for it in items}) != len(items):
            raise ValueError("one KV cache appears twice in a forward")
        pool.ensure_slots(rows)
        lengths = [pool.owner(s).length if s < pool.num_used else 0 for s in range(rows)]
        ids = torch.full((rows, width), _PAD_TOKEN_ID, dtype=torch.long)  # [B, T] on the host
        for it in items:
            ids[it.kv.slot, : len(it.token_ids)] = torch.as_tensor(list(it.token_ids), dtype=torch.long)
        tails = [it for it in items if it.tail is not None]  # tokens that stay on the device
        positions = torch.tensor(lengths, dtype=torch.long).unsqueeze(1) + torch.arange(width)  # [B, T]
        need = max(lengths) + width  # every row, dummy ones too, writes T positions past its length
        # On a GPU in large steps (each growth means new graphs), where the pool's budget allows.
        pool.reserve(need, step=GPU_CAPACITY_STEP if self.use_graphs else 1, slots=rows)
        # Bucketed (what a graph runs): keys past the rows' lengths are read too, under the mask.
        keys = min(pool.capacity, -(-need // KEY_BUCKET) * KEY_BUCKET) if self.pad_to_buckets else need
        k_rows = [k[:rows] for k in pool.k]  # [B, H_kv, capacity, D] views: row b is slot b
        v_rows = [v[:rows] for v in pool.v]
        if self.use_graphs:
            hidden = self._replay(pool, ids, positions, k_rows, v_rows, keys, tails)
        else:
            device_ids = ids.to(self.device)
            place_tails(device_ids, tails, [it.kv.pool_slot for it in tails])
            hidden = self.decode(device_ids, positions.to(self.device), k_rows, v_rows, keys)
        self.forwards += 1
        out = []
        for it in items:
            n = it.length
            it.kv.advance(n)
            out.append(hidden[it.kv.slot, n - it.num_logits : n])  # [num_logits, hidden]
        return out

    def _replay(
        self,
        pool: SlotPool,
        ids: torch.Tensor,  # [B, T] host
        positions: torch.Tensor,  # [B, T] host
        k_rows: list[torch.Tensor],
        v_rows: list[torch.Tensor],
        keys: int,
        tails: Sequence[ForwardItem] = (),  # items with device tails: written into the input buffer
    ) -> torch.Tensor:
        rows, width = ids.shape
        tensors = tuple(t.data_ptr() for t in (*pool.k, *pool.v))
        if tensors != self._pool_tensors:
            # The pool was resized: its old tensors are gone, and a graph reading them must never
            # replay (the allocator may hand the same addresses to other tensors).
            self._drop_graphs()
            self._pool_tensors = tensors
        key = (rows, width, keys)
        buf = self._graphs.get(key)
        # Page-locked copies (torch's caching pinned allocator): the uploads below are then
        # asynchronous and never wait for the device.
        ids, positions = ids.pin_memory(), positions.pin_memory()
        if buf is not None:
            self._graphs.move_to_end(key)
            buf.input_ids.copy_(ids, non_blocking=True)
            place_tails(buf.input_ids, tails, [it.kv.pool_slot for it in tails])  # device to device, behind the copy
            buf.positions.copy_(positions, non_blocking=True)
            assert buf.graph is not None and buf.hidden is not None
            buf.graph.replay()
            self.replays += 1
            return buf.hidden
        buf = _Buffers(ids.to(self.device), positions.to(self.device))
        place_tails(buf.input_ids, tails, [it.kv.pool_slot for it in tails])
        if self.capture_failures >= MAX_CAPTURE_FAILURES:
            return self.decode(buf.input_ids, buf.positions, k_rows, v_rows, keys)
        try:
            self._capture(buf, k_rows, v_rows, keys)
        except RuntimeError:
            # A capture that fails must cost this forward its speed, never the batch its step:
            # the same decoder runs eagerly. Its pool is dropped in case the failure left it in
            # a state the next capture would trip over; after a few failures nothing new is
            # captured (graphs already captured keep replaying).
            self.capture_failures += 1
            logger.warning(
                "CUDA graph capture failed for shape %s (%d of %d before capturing stops); running it eagerly",
                key,
                self.capture_failures,
                MAX_CAPTURE_FAILURES,
                exc_info=True,
            )
            self._graph_pool = None
            return self.decode(buf.input_ids, buf.positions, k_rows, v_rows, keys)
        assert buf.graph is not None and buf.hidden is not None
        buf.graph.replay()  # the capture only recorded: this computes this forward's output
        self._graphs[key] = buf
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        return buf.hidden

    def _capture(self, buf: _Buffers, k_rows: list[torch.Tensor], v_rows: list[torch.Tensor], keys: int) -> None:
        """Warm the decoder up on ``buf``'s inputs and record it into ``buf.graph``."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy kernel choices happen outside the capture
                self.decode(buf.input_ids, buf.positions, k_rows, v_rows, keys)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            buf.hidden = self.decode(buf.input_ids, buf.positions, k_rows, v_rows, keys)
        buf.graph = graph
        self.captures += 1

    def _drop_graphs(self) -> None:
        """Forget every captured graph, and their memory pool with them.

        The pool goes too: once the last graph using a pool is freed, the caching allocator
        releases the pool, and a capture into the old handle fails an internal assertion
        (``use_count > 0``); a fresh handle starts a fresh pool."""
        self._graphs.clear()
        self._graph_pool = None

    def decode(
        self,
        input_ids: torch.Tensor,  # [B, T] int64 on the device
        positions: torch.Tensor,  # [B, T] int64: query (b, t) is at position positions[b, t] of slot b
        k_rows: Sequence[torch.Tensor],  # per layer [B, H_kv, capacity, D]: pool rows 0..B-1
        v_rows: Sequence[torch.Tensor],
        keys: int,  # S: attention reads key positions 0..S-1 of every row
    ) -> torch.Tensor:  # [B, T, hidden]
        """The decoder over fixed shapes: device ops only, no host synchronisation."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        rows, width = input_ids.shape
        batch_index = torch.arange(rows, device=input_ids.device).unsqueeze(1)  # [B, 1]
        # Query (b, t) sees key j of its row iff j <= its position: its past and its own new tokens.
        mask = torch.arange(keys, device=input_ids.device).view(1, 1, 1, keys) <= positions.view(rows, 1, width, 1)
        x = self._embed(input_ids)  # [B, T, hidden]
        cos, sin = self._rotary(x, positions)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        gqa = self._heads != self._kv_heads
        qk_norm = self.arch.qk_norm
        for layer, k_pool, v_pool in zip(self._layers, k_rows, v_rows, strict=True):
            attn = layer.self_attn
            residual = x
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(rows, width, self._heads, self._head_dim)  # [B, T, H, D]
            k = attn.k_proj(h).view(rows, width, self._kv_heads, self._head_dim)
            if qk_norm:  # over the head dimension, before rotary (Qwen3)
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D]
            v = attn.v_proj(h).view(rows, width, self._kv_heads, self._head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            # [B, T, H_kv, D] at (row b, position positions[b, t]): one indexed write per tensor.
            k_pool[batch_index, :, positions] = k.transpose(1, 2)
            v_pool[batch_index, :, positions] = v.transpose(1, 2)
            out = sdpa(
                q, k_pool[:, :, :keys], v_pool[:, :, :keys], attn_mask=mask, scale=self._scaling, enable_gqa=gqa
            )  # [B, H, T, D]
            x = residual + attn.o_proj(out.transpose(1, 2).reshape(rows, width, self._heads * self._head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._norm(x)


def build(model: torch.nn.Module, mode: str, max_model_len: int | None = None) -> StaticForward | None:
    """The static forward for ``model`` under ``mode``, or None (the eager path only).

    "auto" and "on": the static path wherever the architecture is supported, with CUDA
    graphs on a CUDA device; on a CPU it runs unpadded and eagerly (bench.static_forward:
    one batched attention call per layer instead of one per row, and none of the module
    tree's per-call work, made it faster than the packed path on SmolLM2). "on" raises for
    an unsupported architecture instead of falling back. "off": never."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"static forward mode must be auto, on or off, got {mode!r}")
    if mode == "off" or (mode == "auto" and not supports(model, max_model_len)):
        return None
    return StaticForward(model, max_model_len=max_model_len)
