"""Benchmark the GPU worker's speculation modes on the toy model pair.

    python -m bench.worker                      # build/reuse the toy pair, both schema splits
    python -m bench.worker --target-dir T --draft-dir D --max-tokens 96

For every schema split (held-out schemas the toy models never saw, and the
training schemas) and every mode, all schemas decode as one greedy batch
through an in-process ``GpuWorker`` and a real mask service on 127.0.0.1:

    no_spec              speculation off (one token per target forward)
    draft                draft model, no draft-side masks (grammar-blind drafting)
    draft+masks          draft model with draft-side grammar masks
    draft+forced         draft model + grammar-forced drafts
    draft+masks+forced   both (grammar-aware drafting)

Greedy decoding makes every mode emit identical tokens (checked), so the modes
differ only in how many target forwards and how much wall time they need.
Reported per mode: tokens per target forward (emitted tokens, stop token
included, / per-sequence steps; each step is one target forward over that
sequence's k_r + 1 rows),
draft acceptance rate (accepted / proposed drafts), wall ms per emitted token,
and batched draft-model forwards (the cost grammar-forced drafts save).
``grammar_aware_vs_blind`` = tokens per forward of draft+masks+forced over draft.
Last line: ``RESULT {json}`` (top-level numbers are the held-out split).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specmask.common.proposer_kind import ProposerKind

MODES: dict[str, tuple[bool, tuple[str, ...], bool]] = {
    # name: (speculation enabled, proposers, draft_masking)
    "no_spec": (False, (), False),
    "draft": (True, (ProposerKind.DRAFT_MODEL,), False),
    "draft+masks": (True, (ProposerKind.DRAFT_MODEL,), True),
    "draft+forced": (True, (ProposerKind.DRAFT_MODEL, ProposerKind.GRAMMAR_FORCED), False),
    "draft+masks+forced": (True, (ProposerKind.DRAFT_MODEL, ProposerKind.GRAMMAR_FORCED), True),
}
AWARE, BLIND = "draft+masks+forced", "draft"


@dataclass
class ModeResult:
    tokens: int
    forwards: int  # Σ over sequences of steps taken = target forwards each sequence took part in
    proposed: int
    accepted: int
    draft_forwards: int  # batched draft-model forwards (grammar-forced positions skip them)
    wall_s: float
    outputs: dict[str, list[int]]
    steps: int = 0  # worker.step() calls (batched steps)
    mask_wait_s: float = 0.0  # Σ per step of the time the step waited on the mask service

    def row(self) -> dict[str, float]:
        return {
            "tokens_per_forward": self.tokens / max(self.forwards, 1),
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "wall_ms_per_token": 1e3 * self.wall_s / max(self.tokens, 1),
            # Per batched step: wall time, and that time less the mask wait (host work + forwards).
            "wall_ms_per_step": 1e3 * self.wall_s / max(self.steps, 1),
            "ms_per_step_excl_mask_wait": 1e3 * (self.wall_s - self.mask_wait_s) / max(self.steps, 1),
            "steps": self.steps,
            "tokens": self.tokens,
            "target_forwards": self.forwards,
            "drafts_proposed": self.proposed,
            "drafts_accepted": self.accepted,
            "draft_forwards": self.draft_forwards,
        }


def _toy_dirs(args: argparse.Namespace) -> tuple[str, str]:
    if args.target_dir and args.draft_dir:
        from specmask.gpu_worker.models.resolve import resolve_pair

        target, draft = resolve_pair(args.target_dir, args.draft_dir)  # dirs or registered names
        assert draft is not None
        return target, draft
    from specmask.gpu_worker.toy.build import DEFAULT_OUT_DIR, build_toy_models

    result = build_toy_models(args.toy_dir or DEFAULT_OUT_DIR, progress=False)
    return str(result.target_dir), str(result.draft_dir)


def tally_outputs(outs: Sequence[Any], into: Any) -> None:
    """Add one step's outputs (``StepOutput``s) to ``into``'s ``outputs``/``tokens``/``forwards``/
    ``proposed``/``accepted``; an output with an error ends the bench."""
    from specmask.gpu_worker.types import FinishReason

    for out in outs:
        if out.error:
            raise RuntimeError(f"{out.seq_id}: {out.error}")
        into.outputs[out.seq_id].extend(out.new_token_ids)
        # The stop token is emitted by the target but not returned: count it, so that
        # plain decoding is exactly 1 token per forward.
        stopped = out.finish_reason in (FinishReason.STOP, FinishReason.GRAMMAR_COMPLETE)
        into.tokens += len(out.new_token_ids) + int(stopped)
        into.forwards += out.target_forwards
        into.proposed += out.drafts_proposed
        into.accepted += out.drafts_accepted


def run_mode(worker: Any, schemas: dict[str, Any], mode: str, args: argparse.Namespace) -> ModeResult:
    from specmask.common.grammar_spec import GrammarKind, GrammarSpec
    from specmask.gpu_worker.toy.schemas import prompt_for, schema_json
    from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams

    enabled, proposers, masking = MODES[mode]
    spec = SpeculationParams(
        enabled=enabled, k=args.k, proposers=proposers or (ProposerKind.DRAFT_MODEL,), draft_masking=masking
    )
    seqs = [
        NewSequence(
            seq_id=name,
            prompt_token_ids=tuple(worker.tokenizer.encode(prompt_for(name, schema))),
            grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, schema_json(schema)),
            sampling=SamplingParams(max_tokens=args.max_tokens),
            speculation=spec,
        )
        for name, schema in schemas.items()
    ]
    started = time.perf_counter()
    errors = worker.add(seqs, wait_for_sessions=True)
    if any(errors):
        raise RuntimeError(f"add failed: {errors}")
    result = ModeResult(0, 0, 0, 0, 0, 0.0, {s.seq_id: [] for s in seqs})
    draft_forwards_before = worker.draft.num_forwards if worker.draft is not None else 0
    while worker.num_active():
        outs = worker.step()
        result.steps += 1
        result.mask_wait_s += max((o.mask_time_s for o in outs), default=0.0)
        tally_outputs(outs, result)
    result.wall_s = time.perf_counter() - started
    if worker.draft is not None:
        result.draft_forwards = worker.draft.num_forwards - draft_forwards_before
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-dir", help="HF target model dir or registered name (default: the toy pair)")
    parser.add_argument("--draft-dir", help="HF draft model dir or registered name (default: the toy pair)")
    parser.add_argument("--toy-dir", type=Path, help="where to build/reuse the toy pair (default .specmask/toy-models)")
    parser.add_argument("--k", type=int, default=4, help="max drafts per step (default 4)")
    parser.add_argument("--max-tokens", type=int, default=160, help="output budget per sequence (default 160)")
    parser.add_argument("--splits", default="heldout,train", help="comma list of heldout,train")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of modes")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode; wall time is the best run")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--torch-threads", type=int, default=1, help="CPU intra-op threads (default 1)")
    parser.add_argument("--mask-threads", type=int, default=1, help="mask-service worker threads (default 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from specmask.gpu_worker.actor import GpuWorker
    from specmask.gpu_worker.config import WorkerConfig
    from specmask.gpu_worker.toy.schemas import HELDOUT_SCHEMAS, TRAIN_SCHEMAS
    from specmask.mask_service.server.config import MaskServiceConfig
    from specmask.mask_service.server.server import build_service
    from specmask.mask_service.server.tokenizers import TokenizerSource

    target_dir, draft_dir = _toy_dirs(args)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {list(MODES)}")
    splits = {"heldout": HELDOUT_SCHEMAS, "train": TRAIN_SCHEMAS}
    service = build_service(
        MaskServiceConfig(
            tokenizers=(TokenizerSource(target_dir),), host="127.0.0.1", port=0, mask_threads=args.mask_threads
        )
    )
    service.server.start()
    worker = GpuWorker(
        WorkerConfig(
            target_dir=target_dir,
            draft_dir=draft_dir,
            device=args.device,
            mask_service_addresses=(f"127.0.0.1:{service.port}",),
            max_k=max(args.k, 1),
            torch_threads=args.torch_threads,
        )
    )
    report: dict[str, Any] = {}
    try:
        print(f"target={target_dir} draft={draft_dir} device={worker.device} k={args.k} max_tokens={args.max_tokens}")
        for split in [s for s in args.splits.split(",") if s]:
            schemas = splits[split]
            rows: dict[str, dict[str, float]] = {}
            reference: dict[str, list[int]] | None = None
            for mode in modes:
                runs = [run_mode(worker, schemas, mode, args) for _ in range(max(1, args.repeats))]
                best = min(runs, key=lambda r: r.wall_s)
                if reference is None:
                    reference = best.outputs
                elif best.outputs != reference:
                    raise AssertionError(f"{split}/{mode}: greedy output differs from {modes[0]}")
                rows[mode] = best.row()
            ratio = None
            if AWARE in rows and BLIND in rows:
                ratio = rows[AWARE]["tokens_per_forward"] / rows[BLIND]["tokens_per_forward"]
            report[split] = {"schemas": len(schemas), "modes": rows, "grammar_aware_vs_blind": ratio}
            print(f"\n{split} schemas ({len(schemas)} sequences, greedy, identical outputs across modes)")
            print(
                f"{'mode':<20} {'tok/fwd':>8} {'accept':>7} {'ms/tok':>8} {'ms/step':>8} {'tokens':>7} {'fwds':>6} "
                f"{'draft fwds':>10}"
            )
            for mode, r in rows.items():
                print(
                    f"{mode:<20} {r['tokens_per_forward']:>8.2f} {r['acceptance_rate']:>7.2f} "
                    f"{r['wall_ms_per_token']:>8.2f} {r['wall_ms_per_step']:>8.2f} {r['tokens']:>7d} "
                    f"{r['target_forwards']:>6d} {r['draft_forwards']:>10d}"
                )
            if ratio is not None:
                print(f"grammar_aware_vs_blind ({AWARE} / {BLIND} tokens per forward): {ratio:.2f}x")
    finally:
        worker.shutdown()
        service.stop(grace_s=1.0)

    main_split = "heldout" if "heldout" in report else next(iter(report))
    result = {
        "split": main_split,
        "tokens_per_forward": {m: r["tokens_per_forward"] for m, r in report[main_split]["modes"].items()},
        "acceptance_rate": {m: r["acceptance_rate"] for m, r in report[main_split]["modes"].items()},
        "wall_ms_per_token": {m: r["wall_ms_per_token"] for m, r in report[main_split]["modes"].items()},
        "wall_ms_per_step": {m: r["wall_ms_per_step"] for m, r in report[main_split]["modes"].items()},
        "grammar_aware_vs_blind": report[main_split]["grammar_aware_vs_blind"],
        "splits": report,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "device": str(worker.device),
    }
    print("RESULT " + json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
