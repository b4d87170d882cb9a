"""Host time per step of the worker's mask-row data path: dense rows vs row ids.

    python -m bench.mask_rows                      # B in {8, 32, 64}, k = 4, V in {49,152, 128,256}
    python -m bench.mask_rows --batches 32 --steps 200

What one speculative step does with mask rows on the host, for B grammar
sequences drafting k positions with draft-side masks and grammar-forced drafts
(the worker's default), from the decoded reply to the kernels' inputs:

* k draft-side replies (one row per sequence: M_{i-1}) and one verify reply
  (M_k), each absorbed into the client's interned ``RowTable`` (common to both
  paths, timed in both);
* per position: forced-token detection, the draft-side bitmask table + row ids,
  a ``MaskRow.allows`` check of each proposal;
* verify: the k + 1 rows of every sequence as one table + row ids.

``dense`` is the earlier form (before commit a25f1fd): the client gathered
every reply's rows into a dense array under its lock, wrapped each request's
rows as a torch tensor, the drafter kept per-position [W] rows, grammar-forced
detection popcounted the stacked rows, the draft proposer stacked a table per
position, the step stacked/concatenated each sequence's rows and the verifier
concatenated them with an all-ones row into a fresh table. Those operations
are reproduced below (``_DenseStep``) as the A side; the B side (``ids``) is
the worker's code today: ``MaskRows`` slots, ``MaskRow.forced_token`` from the counts
that came with the rows, and ``gpu_worker.mask_table.DeviceMaskTable.resolve``
(on CPU a zero-copy mirror; ``--upload`` runs the accelerator's copy path).
Kernels are not timed: they get the same logits and rows either way.

``decode new ms``: the mask-io thread's side, ``RowTable.absorb`` of one reply
whose B x (k + 1) rows are all new to the client (a cold table, the worst
case), with grammar-like rows (most allow or forbid a handful of tokens).

Rows are synthetic, at the real widths: a pool of distinct rows (a few allow a
single token) reused across sequences and steps, as real schemas do (82% of
rows repeat). Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

VOCABS = {"smollm2": 49152, "llama3": 128256}
# popcount of every byte value (the dense path's grammar-forced detection, as it was).
_BYTE_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int32)


def _pool(num_rows: int, vocab: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Distinct [W] int32 rows: every 8th allows one token, the rest about half the vocabulary."""
    words = (vocab + 31) // 32
    rows = []
    for i in range(num_rows):
        if i % 8 == 0:
            row = np.zeros(words, np.int32)
            token = int(rng.integers(0, vocab))
            row[token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))
        else:
            row = rng.integers(-(2**31), 2**31, words, dtype=np.int64).astype(np.int32)
            if vocab % 32:
                row[-1] &= (1 << (vocab % 32)) - 1
        rows.append(row)
    return rows


class _Replies:
    """Absorbs synthetic replies into a real RowTable, as the client does (both paths)."""

    def __init__(self, pool: list[np.ndarray], capacity: int) -> None:
        from specmask.mask_service.client.row_table import RowTable
        from specmask.mask_service.wire import encode_row, row_content_id
        from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb

        width = pool[0].shape[0]
        self.table = RowTable(width, capacity)
        self.ids = [row_content_id(r.tobytes(), width) for r in pool]
        self.new_rows = []
        for rid, row in zip(self.ids, pool):
            enc, payload, allowed = encode_row(row)
            self.new_rows.append(pb.NewRow(row_id=rid, encoding=enc, payload=payload, allowed_count=allowed))
        self.table.absorb(self.new_rows, [])  # rows already held: replies carry ids only

    def reply(self, picks: list[int]) -> tuple[Any, np.ndarray]:
        """(table view, slots) of one batched reply naming pool rows ``picks``."""
        slots = self.table.absorb((), [self.ids[p] for p in picks])
        return self.table.view(), slots


class _DenseStep:
    """The worker's mask-row handling before commit a25f1fd (see the module docstring)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.words = (vocab + 31) // 32

    def client(self, view: Any, slots: np.ndarray) -> list[torch.Tensor]:
        dense = view.words[slots]  # the gather under the client lock
        return [torch.from_numpy(dense[i : i + 1]) for i in range(len(slots))]  # per request

    def forced(self, rows: list[torch.Tensor]) -> list[int | None]:
        valid = torch.stack(rows).clone()  # single_allowed_tokens: stack, clear tail bits, popcount
        tail = self.vocab % 32
        if tail:
            valid[..., -1] &= (1 << tail) - 1
        counts = _BYTE_POPCOUNT[valid.contiguous().view(torch.uint8).long()].sum(dim=-1, dtype=torch.int32)
        out: list[int | None] = [None] * valid.shape[0]
        for r in torch.nonzero(counts == 1).flatten().tolist():
            word = int(torch.nonzero(valid[r]).flatten()[0])
            out[r] = 32 * word + (int(valid[r, word]) & 0xFFFFFFFF).bit_length() - 1
        return out

    @staticmethod
    def allowed(row: torch.Tensor, token: int) -> bool:
        return bool((int(row[token >> 5]) >> (token & 31)) & 1)

    def step(self, replies: list[tuple[Any, np.ndarray]], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        *draft_replies, verify_reply = replies
        kept: list[list[torch.Tensor]] = [[] for _ in tokens]
        for view, slots in draft_replies:
            per_item = self.client(view, slots)
            rows = [res[-1] for res in per_item]  # DraftSlot.mask_row
            self.forced(rows)
            table = torch.stack(rows)  # draft proposer's table, all rows masked
            torch.arange(len(rows), dtype=torch.int32)
            for r, row in enumerate(rows):
                self.allowed(row, tokens[r])
                kept[r].append(row)
        per_item = self.client(*verify_reply)
        masks = [torch.cat([*(row.unsqueeze(0) for row in kept[r]), per_item[r]]) for r in range(len(tokens))]
        ones = torch.full((1, self.words), -1, dtype=torch.int32)
        table = torch.cat([*masks, ones])  # the verifier's fresh table
        row_ids = torch.tensor(list(range(sum(m.shape[0] for m in masks))), dtype=torch.int32)
        return table, row_ids


class _IdsStep:
    """The worker's mask-row handling today: slots of the client table, one device-resident table."""

    def __init__(self, vocab: int, *, upload: bool) -> None:
        from specmask.gpu_worker.mask_table import DeviceMaskTable

        self.vocab = vocab
        self.mirror = DeviceMaskTable("cpu", zero_copy=not upload)

    def step(self, replies: list[tuple[Any, np.ndarray]], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        from specmask.mask_service.client.row_table import MaskRows

        *draft_replies, verify_reply = replies
        kept: list[list[Any]] = [[] for _ in tokens]
        for view, slots in draft_replies:
            rows = [MaskRows(view, slots[i : i + 1])[-1] for i in range(len(slots))]  # DraftSlot.mask_row
            for row in rows:
                row.forced_token(self.vocab)
            self.mirror.resolve(rows)  # the draft proposer's table and ids
            for r, row in enumerate(rows):
                row.allows(tokens[r])
                kept[r].append(row)
        view, slots = verify_reply
        # As the step hands them to the verifier: each sequence's rows as one block.
        blocks = [MaskRows.join(kept[r], MaskRows(view, slots[r : r + 1])) for r in range(len(tokens))]
        return self.mirror.resolve_blocks([b for b in blocks if b is not None])


def measure_decode(vocab: int, batch: int, k: int, steps: int, seed: int = 0) -> float:
    """Median ms to absorb one reply whose B x (k + 1) rows are all new to the client (a cold
    table: the worst case for the mask-io thread), rows drawn from a grammar-like pool: most
    allow a handful of tokens (sparse on the wire), some forbid a handful, a few are dense."""
    from specmask.mask_service.client.row_table import RowTable
    from specmask.mask_service.wire import encode_row, row_content_id
    from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb

    rng = np.random.default_rng(seed)
    words = (vocab + 31) // 32
    n = batch * (k + 1)
    times = []
    for _ in range(steps):
        new_rows = []
        for i in range(n):
            kind = i % 10
            if kind < 7:  # a handful allowed
                row = np.zeros(words * 32, np.uint8)
                row[rng.integers(0, vocab, int(rng.integers(1, 17)))] = 1
            elif kind < 9:  # a handful forbidden
                row = np.ones(words * 32, np.uint8)
                row[rng.integers(0, vocab, int(rng.integers(1, 17)))] = 0
            else:  # dense: about half the vocabulary
                row = (rng.random(words * 32) < 0.5).astype(np.uint8)
            packed = np.packbits(row, bitorder="little").view("<i4")
            enc, payload, allowed = encode_row(packed)
            new_rows.append(
                pb.NewRow(
                    row_id=row_content_id(packed.tobytes(), words), encoding=enc, payload=payload, allowed_count=allowed
                )
            )
        reply = pb.DraftMasksResponse(new_rows=new_rows, row_ids=[r.row_id for r in new_rows])
        table = RowTable(words, n + 1)
        t0 = time.perf_counter()
        table.absorb(reply.new_rows, reply.row_ids)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(vocab: int, batch: int, k: int, steps: int, upload: bool, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    pool = _pool(256, vocab, rng)
    replies = _Replies(pool, capacity=2048)
    paths: dict[str, _DenseStep | _IdsStep] = {"dense": _DenseStep(vocab), "ids": _IdsStep(vocab, upload=upload)}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for step in range(steps + 3):
        picks = [rng.integers(0, len(pool), batch).tolist() for _ in range(k + 1)]
        tokens = rng.integers(0, vocab, batch).tolist()
        order = list(paths.items()) if step % 2 else list(reversed(paths.items()))  # alternate A/B
        outputs = {}
        for name, path in order:
            t0 = time.perf_counter()
            got = [replies.reply(p) for p in picks]  # the client's absorb, in both paths
            outputs[name] = path.step(got, tokens)
            if step >= 3:  # warm-up steps untimed
                times[name].append(time.perf_counter() - t0)
        (dt, di), (it, ii) = outputs["dense"], outputs["ids"]
        if not torch.equal(dt[di.long()], it[ii.long()]):  # same rows behind the ids, row for row
            raise AssertionError("the two paths disagree on the rows")
    med = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {"dense_ms": med["dense"], "ids_ms": med["ids"], "saved_ms": med["dense"] - med["ids"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32,64", help="comma list of B (default 8,32,64)")
    parser.add_argument("--vocabs", default=",".join(VOCABS), help=f"comma list of {list(VOCABS)}")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per cell (median reported)")
    parser.add_argument("--upload", action="store_true", help="copy rows into the mirror (a GPU's path) on CPU")
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    batches = [int(b) for b in args.batches.split(",") if b]
    vocabs = [v for v in args.vocabs.split(",") if v]
    for bad in [v for v in vocabs if v not in VOCABS]:
        parser.error(f"unknown vocab {bad!r}; known {list(VOCABS)}")
    cells: dict[str, dict[str, dict[str, float]]] = {}
    print(f"mask-row host time per step, k={args.k}, {args.steps} steps per cell (median), upload={args.upload}")
    print(
        f"{'vocab':<9} {'V':>7} {'B':>4} {'dense ms':>9} {'ids ms':>8} {'saved ms':>9} {'ratio':>6} "
        f"{'decode new ms':>13}"
    )
    for name in vocabs:
        cells[name] = {}
        for batch in batches:
            cell = measure(VOCABS[name], batch, args.k, args.steps, args.upload)
            cell["decode_new_rows_ms"] = measure_decode(VOCABS[name], batch, args.k, max(args.steps // 4, 5))
            cells[name][str(batch)] = cell
            print(
                f"{name:<9} {VOCABS[name]:>7} {batch:>4} {cell['dense_ms']:>9.3f} {cell['ids_ms']:>8.3f} "
                f"{cell['saved_ms']:>9.3f} {cell['dense_ms'] / cell['ids_ms']:>6.2f} "
                f"{cell['decode_new_rows_ms']:>13.3f}",
                flush=True,
            )
    result = {"k": args.k, "steps": args.steps, "upload": args.upload, "cells": cells}
    print("RESULT " + json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
