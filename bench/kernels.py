"""Benchmark the verification-step kernels: Triton vs PyTorch reference vs xgrammar.

    python -m bench.kernels            # GPU: full grid; CPU: a small grid (reference + xgrammar)
    python -m bench.kernels --quick    # one tiny shape per op: checks that everything runs

For each op and shape it reports the median time and the bandwidth achieved
against the bytes the op *must* move (not what an implementation happens to
move), so the numbers compare across implementations:
* bitmask apply: read the mask (4 B per word) + write -inf to each disallowed logit;
* rejection_sample: read the target logits and the draft probabilities once;
* rejection_checked: the same with the on-device mask check, which
  adds one mask word and one row id per emitted token (``mask_check_overhead``
  in the RESULT: checked / plain - 1 per shape);
* sample_draft: read the draft logits, write the q rows.
xgrammar's `apply_token_bitmask_inplace` runs on the same inputs in the same run.
Triton is timed on CUDA only: under TRITON_INTERPRET=1 it measures NumPy, not a kernel.
Last line: `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from specmask.kernels.backend import Backend
from specmask.kernels.bitmask import apply_token_bitmask_inplace
from specmask.kernels.draft_sampling import sample_draft
from specmask.kernels.rejection import rejection_sample
from specmask.kernels.sampling_params import SamplingTensors

FULL_GRID = dict(batch=(1, 8, 64), num_drafts=(0, 4, 8), vocab=(32000, 128256, 151936))
CPU_GRID = dict(batch=(1, 8), num_drafts=(0, 4), vocab=(32000,))
QUICK_GRID = dict(batch=(2,), num_drafts=(2,), vocab=(4099,))
# Half the vocabulary allowed: a JSON-ish grammar state is far sparser, but
# this keeps the -inf writes (which count toward the bytes) non-trivial.
MASK_DENSITY = 0.5


@dataclass(frozen=True)
class Row:
    op: str
    impl: str
    batch: int
    num_drafts: int
    vocab: int
    ms: float
    bytes: int
    gbps: float


def _timeit(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median milliseconds of `reps` calls after one warm-up (compiles Triton on first use)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _inputs(batch: int, num_drafts: int, vocab: int, device: torch.device, gen: torch.Generator):
    num_tokens = batch * (num_drafts + 1)
    logits = torch.randn(num_tokens, vocab, generator=gen).to(device)  # [num_tokens, V]
    allowed = torch.rand(num_tokens, vocab, generator=gen) < MASK_DENSITY
    words = (vocab + 31) // 32
    padded = torch.zeros(num_tokens, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(num_tokens, words, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).to(device)  # [num_tokens, W]
    num_disallowed = int((~allowed).sum())
    draft_probs = torch.softmax(torch.randn(batch * num_drafts, vocab, generator=gen), -1).to(device)
    draft_ids = (
        torch.multinomial(draft_probs.cpu(), 1, generator=gen).squeeze(1).to(device)
        if num_drafts
        else torch.empty(0, dtype=torch.long, device=device)
    )
    cu = (torch.arange(1, batch + 1, dtype=torch.int32) * num_drafts).to(device)  # [B]
    sampling = SamplingTensors.from_lists(
        [0.0 if r % 2 == 0 else 1.0 for r in range(batch)], seeds=list(range(batch)), device=device
    )  # mixed greedy / random
    return logits, bitmask, num_disallowed, draft_probs, draft_ids, cu, sampling


def run(grid: dict, device: torch.device, reps: int) -> list[Row]:
    import xgrammar

    impls = [("reference", Backend.REFERENCE)]
    if device.type == "cuda":
        impls.insert(0, ("triton", Backend.TRITON))
    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    for batch, num_drafts, vocab in itertools.product(grid["batch"], grid["num_drafts"], grid["vocab"]):
        logits, bitmask, num_disallowed, draft_probs, draft_ids, cu, sampling = _inputs(
            batch, num_drafts, vocab, device, gen
        )
        elem = logits.element_size()
        shape = dict(batch=batch, num_drafts=num_drafts, vocab=vocab)

        def add(op: str, impl: str, ms: float, nbytes: int) -> None:
            rows.append(Row(op, impl, **shape, ms=ms, bytes=nbytes, gbps=nbytes / ms / 1e6))

        mask_bytes = bitmask.numel() * 4 + num_disallowed * elem
        work = logits.clone()
        for name, backend in impls:
            add(
                "apply_bitmask",
                name,
                _timeit(lambda: apply_token_bitmask_inplace(work, bitmask, backend=backend), device, reps),
                mask_bytes,
            )
        add(
            "apply_bitmask",
            "xgrammar",
            _timeit(lambda: xgrammar.apply_token_bitmask_inplace(work, bitmask), device, reps),
            mask_bytes,
        )

        apply_token_bitmask_inplace(logits, bitmask, backend=Backend.REFERENCE)
        reject_bytes = logits.numel() * elem + draft_probs.numel() * 4
        row_ids = torch.arange(logits.shape[0], dtype=torch.int32, device=device)  # [num_tokens]
        for name, backend in impls:
            ms = _timeit(
                lambda: rejection_sample(draft_ids, cu, draft_probs, logits, sampling, backend=backend), device, reps
            )
            add("rejection_sample", name, ms, reject_bytes)
            # The on-device never-lie mask check: one mask word (+ its row id) read per emitted token.
            ms = _timeit(
                lambda: rejection_sample(
                    draft_ids,
                    cu,
                    draft_probs,
                    logits,
                    sampling,
                    mask_table=bitmask,
                    mask_row_ids=row_ids,
                    backend=backend,
                ),
                device,
                reps,
            )
            add("rejection_checked", name, ms, reject_bytes + batch * (num_drafts + 1) * 8)

        draft_logits = logits[:batch]
        draft_bytes = draft_logits.numel() * elem + draft_logits.numel() * 4
        for name, backend in impls:
            add(
                "sample_draft",
                name,
                _timeit(lambda: sample_draft(draft_logits, sampling, backend=backend), device, reps),
                draft_bytes,
            )
    return rows


def _check_overhead(rows: list[Row]) -> dict[str, float]:
    """rejection_checked / rejection_sample - 1 per impl and shape (the cost of the mask check)."""
    plain = {(r.impl, r.batch, r.num_drafts, r.vocab): r.ms for r in rows if r.op == "rejection_sample"}
    return {
        f"{r.impl} B={r.batch} k={r.num_drafts} V={r.vocab}": round(r.ms / plain[key] - 1, 4)
        for r in rows
        if r.op == "rejection_checked" and (key := (r.impl, r.batch, r.num_drafts, r.vocab)) in plain
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny shape per op (a smoke run)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per measurement")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    grid = QUICK_GRID if args.quick else (FULL_GRID if device.type == "cuda" else CPU_GRID)
    reps = args.reps or (3 if args.quick else (20 if device.type == "cuda" else 5))
    rows = run(grid, device, reps)

    print(f"{'op':<17} {'impl':<10} {'B':>3} {'k':>2} {'V':>7} {'ms':>9} {'MB':>8} {'GB/s':>8}")
    for r in rows:
        shape = f"{r.batch:>3} {r.num_drafts:>2} {r.vocab:>7}"
        print(f"{r.op:<17} {r.impl:<10} {shape} {r.ms:>9.3f} {r.bytes / 1e6:>8.2f} {r.gbps:>8.2f}")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {
        "device": device_name,
        "quick": args.quick,
        "triton": "timed"
        if device.type == "cuda"
        else "not timed: no CUDA device (interpreter timings are meaningless)",
        "rows": [asdict(r) for r in rows],
        "mask_check_overhead": _check_overhead(rows),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
