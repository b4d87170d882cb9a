"""End-to-end benchmark: schema-constrained requests through the whole stack.

    python -m bench.e2e --schemas toy --n 64                  # in-distribution for the toy pair
    python -m bench.e2e --schemas tests/data/maskbench       # real schemas the toy pair never saw

Brings up the local stack (mask service, Ray worker, orchestrator; the toy
pair unless --target/--draft), then sends the same N prompts, all at once
(bounded by --concurrency), in three phases, all greedy:

* ``constrained``: each schema as the grammar, speculation on (draft masking on);
* ``unconstrained``: no grammar, speculation on, same model and prompts; each
  request generates exactly as many tokens as its constrained run did
  (``ignore_eos`` + that ``max_tokens``), so both phases step the same batch
  shapes and differ only in grammar work;
* ``constrained-nodraftmask``: grammar on, draft-side masking off (masks only
  on the verify path, where they overlap the target forward);
* ``constrained-nospec``: grammar on, speculation off.

The four phases run ``--rounds`` times (default 3), alternating, so drift on a
shared machine hits every phase alike. Step time is the orchestrator-side time
of one worker step (Ray round trip included, prefill excluded), from the
server's own metrics. constrained_vs_unconstrained_step_time = constrained /
unconstrained mean step time within a round, median over rounds (goal <= 1.05:
mask work hides behind the target forward); spec_vs_nonspec_speedup =
completion tokens/s of constrained over constrained-nospec (greedy: both
produce the same tokens), likewise. The table sums all rounds.

Prints a table and, last, ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import jsonschema

from orchestrator.client import StreamedResult, build_request
from orchestrator.local_stack import RunningStack, StackConfig, ensure_toy_models, running_stack
from orchestrator.types import Usage
from proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from proto.gen.specmask.orchestrator.v1 import orchestrator_pb2_grpc as pb_grpc

REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Case:
    name: str
    schema: Any  # parsed JSON Schema
    prompt: str


@dataclass
class PhaseStats:
    phase: str
    requests: int = 0
    valid: int = 0
    invalid: int = 0
    truncated: int = 0  # finish LENGTH: cut before the document closed
    refused: int = 0  # INVALID_ARGUMENT
    errors: int = 0  # other RPC errors, finish ERROR
    usage: Usage = field(default_factory=Usage)  # summed over the phase's requests
    wall_s: float = 0.0
    steps: int = 0
    step_s: float = 0.0
    sequence_steps: int = 0
    error_samples: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.usage.completion_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def mean_step_ms(self) -> float:
        return 1000 * self.step_s / self.steps if self.steps else 0.0

    @property
    def mean_batch(self) -> float:
        return self.sequence_steps / self.steps if self.steps else 0.0


TOY_SCHEMAS = "toy"


def load_cases(schemas: str, n: int | None) -> list[Case]:
    """``--schemas toy``: the toy pair's own schemas (in-distribution prompts). Otherwise a dir of
    ``*.json`` files: a bare JSON Schema, or a JSONSchemaBench record with a "schema" key."""
    from gpu_worker.toy.schemas import all_schemas, prompt_for

    cases = []
    if schemas == TOY_SCHEMAS:
        cases = [Case(name, schema, prompt_for(name, schema)) for name, schema in all_schemas().items()]
    else:
        for path in sorted(Path(schemas).glob("*.json")):
            doc = json.loads(path.read_text())
            schema = doc["schema"] if isinstance(doc, dict) and "schema" in doc and "tests" in doc else doc
            cases.append(Case(path.stem, schema, prompt_for(path.stem)))
    if not cases:
        raise SystemExit(f"no *.json schemas in {schemas}")
    if n is not None:
        cases = (cases * (n // len(cases) + 1))[:n]
    return cases


async def _one(
    stub: pb_grpc.OrchestratorServiceStub,
    case: Case,
    index: int,
    stats: PhaseStats,
    *,
    constrained: bool,
    speculation: bool,
    draft_masking: bool,
    max_tokens: int,
    ignore_eos: bool,
    gate: asyncio.Semaphore,
    lengths: list[int],
) -> None:
    req = build_request(
        case.prompt,
        schema=case.schema if constrained else None,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        temperature=0.0,
        speculation=speculation,
        draft_masking=draft_masking if speculation else None,
        request_id=f"{stats.phase}-{index}",
    )
    result = StreamedResult()
    async with gate:
        try:
            async for chunk in stub.GenerateStream(req, timeout=REQUEST_TIMEOUT_S):
                result.add(chunk)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                stats.refused += 1
            else:
                stats.errors += 1
                stats.error_samples.append(f"{case.name}: {exc.code().name}: {exc.details()}")
            return
    usage = result.usage or pb.Usage()
    lengths[index] = usage.completion_tokens
    stats.usage.completion_tokens += usage.completion_tokens
    stats.usage.target_forwards += usage.target_forwards
    stats.usage.drafts_proposed += usage.drafts_proposed
    stats.usage.drafts_accepted += usage.drafts_accepted
    if result.finish_reason == pb.FINISH_REASON_ERROR:
        stats.errors += 1
        stats.error_samples.append(f"{case.name}: finish ERROR: {result.error}")
    elif result.finish_reason == pb.FINISH_REASON_LENGTH:
        stats.truncated += 1
    elif constrained:
        try:
            jsonschema.validate(json.loads(result.text), case.schema)
            stats.valid += 1
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
            stats.invalid += 1
            stats.error_samples.append(f"{case.name}: invalid output: {str(exc).splitlines()[0]}")


async def run_phase(
    running: RunningStack,
    cases: list[Case],
    phase: str,
    *,
    constrained: bool,
    speculation: bool = True,
    draft_masking: bool = True,
    max_tokens: int | list[int],
    concurrency: int,
) -> tuple[PhaseStats, list[int]]:
    """Run one phase; ``max_tokens`` per request (a list) means exactly that many (ignore_eos)."""
    stats = PhaseStats(phase=phase, requests=len(cases))
    exact = isinstance(max_tokens, list)
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(cases)
    lengths = [0] * len(cases)
    metrics = running.server.metrics
    steps0, step_s0, seqs0 = metrics.step_totals()
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(running.address) as channel:
        stub = pb_grpc.OrchestratorServiceStub(channel)
        started = time.monotonic()
        await asyncio.gather(
            *(
                _one(
                    stub,
                    c,
                    i,
                    stats,
                    constrained=constrained,
                    speculation=speculation,
                    draft_masking=draft_masking,
                    max_tokens=max(1, budgets[i]),
                    ignore_eos=exact,
                    gate=gate,
                    lengths=lengths,
                )
                for i, c in enumerate(cases)
            )
        )
        stats.wall_s = time.monotonic() - started
    steps1, step_s1, seqs1 = metrics.step_totals()
    stats.steps, stats.step_s, stats.sequence_steps = steps1 - steps0, step_s1 - step_s0, seqs1 - seqs0
    return stats, lengths


def print_table(phases: list[PhaseStats]) -> None:
    cols = (
        "phase",
        "req",
        "valid",
        "invalid",
        "cut",
        "refused",
        "errors",
        "tokens",
        "wall s",
        "tok/s",
        "step ms",
        "batch",
        "tok/fwd",
        "accept",
    )
    rows = [
        (
            p.phase,
            p.requests,
            p.valid,
            p.invalid,
            p.truncated,
            p.refused,
            p.errors,
            p.usage.completion_tokens,
            f"{p.wall_s:.1f}",
            f"{p.tokens_per_s:.0f}",
            f"{p.mean_step_ms:.2f}",
            f"{p.mean_batch:.1f}",
            f"{p.usage.tokens_per_target_forward:.2f}",
            f"{p.usage.acceptance_rate:.0%}",
        )
        for p in phases
    ]
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(str(c).rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(v).rjust(w) for v, w in zip(r, widths)))
    for p in phases:
        for sample in p.error_samples[:5]:
            print(f"  [{p.phase}] {sample}")


PHASES = ("constrained", "unconstrained", "constrained-nodraftmask", "constrained-nospec")


def merge(rounds: list[PhaseStats]) -> PhaseStats:
    """One phase's stats summed over rounds (means then weigh every step and token alike)."""
    total = PhaseStats(phase=rounds[0].phase)
    for r in rounds:
        for name in (
            "requests",
            "valid",
            "invalid",
            "truncated",
            "refused",
            "errors",
            "wall_s",
            "steps",
            "step_s",
            "sequence_steps",
        ):
            setattr(total, name, getattr(total, name) + getattr(r, name))
        for name in ("completion_tokens", "target_forwards", "drafts_proposed", "drafts_accepted"):
            setattr(total.usage, name, getattr(total.usage, name) + getattr(r.usage, name))
        total.error_samples += r.error_samples
    return total


async def run_round(running: RunningStack, cases: list[Case], args: argparse.Namespace) -> dict[str, PhaseStats]:
    """The four phases back to back; the unconstrained one replays the constrained lengths."""
    common: dict[str, Any] = {"concurrency": args.concurrency}
    constrained, lengths = await run_phase(
        running, cases, "constrained", constrained=True, max_tokens=args.max_tokens, **common
    )
    unconstrained, _ = await run_phase(running, cases, "unconstrained", constrained=False, max_tokens=lengths, **common)
    nodraftmask, _ = await run_phase(
        running,
        cases,
        "constrained-nodraftmask",
        constrained=True,
        draft_masking=False,
        max_tokens=args.max_tokens,
        **common,
    )
    nospec, _ = await run_phase(
        running,
        cases,
        "constrained-nospec",
        constrained=True,
        speculation=False,
        max_tokens=args.max_tokens,
        **common,
    )
    return {p.phase: p for p in (constrained, unconstrained, nodraftmask, nospec)}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _median(values: list[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    return present[len(present) // 2] if present else None


async def bench(args: argparse.Namespace, cases: list[Case], stack: StackConfig) -> dict[str, Any]:
    async with running_stack(stack, max_queue=max(256, 2 * len(cases)), max_batch=args.max_batch) as running:
        # Warm-up: first steps pay for lazy init (allocator, kernels, grammar compiles).
        await run_phase(running, cases, "warmup", constrained=True, max_tokens=8, concurrency=args.concurrency)
        # Phases alternate round by round, so drift on a shared box hits all of them
        # alike; ratios are taken within a round and the median over rounds reported.
        rounds = [await run_round(running, cases, args) for _ in range(args.rounds)]
        device = running.server.info.device
    merged = {name: merge([r[name] for r in rounds]) for name in PHASES}
    constrained, unconstrained = merged["constrained"], merged["unconstrained"]
    nodraftmask, nospec = merged["constrained-nodraftmask"], merged["constrained-nospec"]
    print_table(list(merged.values()))

    def per_round(a: str, b: str, metric: str) -> list[float | None]:
        return [_ratio(getattr(r[a], metric), getattr(r[b], metric)) for r in rounds]

    step_ratios = per_round("constrained", "unconstrained", "mean_step_ms")
    nodraftmask_ratios = per_round("constrained-nodraftmask", "unconstrained", "mean_step_ms")
    speedups = per_round("constrained", "constrained-nospec", "tokens_per_s")
    return {
        "rounds": args.rounds,
        "requests": constrained.requests,
        "valid": constrained.valid,
        "invalid": constrained.invalid,
        "truncated": constrained.truncated,
        "refused": constrained.refused,
        "errors": sum(p.errors for p in merged.values()),
        "tokens_per_target_forward": round(constrained.usage.tokens_per_target_forward, 3),
        "acceptance_rate": round(constrained.usage.acceptance_rate, 3),
        "constrained_step_ms": round(constrained.mean_step_ms, 3),
        "unconstrained_step_ms": round(unconstrained.mean_step_ms, 3),
        "constrained_nodraftmask_step_ms": round(nodraftmask.mean_step_ms, 3),
        "constrained_vs_unconstrained_step_time": _median(step_ratios),
        "constrained_vs_unconstrained_step_time_rounds": step_ratios,
        "nodraftmask_vs_unconstrained_step_time": _median(nodraftmask_ratios),
        "nodraftmask_vs_unconstrained_step_time_rounds": nodraftmask_ratios,
        "spec_tokens_per_s": round(constrained.tokens_per_s, 1),
        "nonspec_tokens_per_s": round(nospec.tokens_per_s, 1),
        "spec_vs_nonspec_speedup": _median(speedups),
        "spec_vs_nonspec_speedup_rounds": speedups,
        "device": device,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--schemas",
        required=True,
        help="dir of *.json schemas (bare or JSONSchemaBench), or 'toy' for the toy pair's schemas",
    )
    parser.add_argument("--n", type=int, default=None, help="requests (cycles through the schemas; default: one each)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--max-batch", type=int, default=64, help="active sequences per worker")
    parser.add_argument("--rounds", type=int, default=3, help="times the four phases run, alternating")
    parser.add_argument("--target", default=None, help="target model dir (default: the toy pair)")
    parser.add_argument("--draft", default=None, help="draft model dir (default: the toy pair's)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cases = load_cases(args.schemas, args.n)
    if args.target is None:
        target, draft = ensure_toy_models(progress=False)
        draft = args.draft or draft
    else:
        target, draft = args.target, args.draft
    result = asyncio.run(bench(args, cases, StackConfig(target_dir=target, draft_dir=draft)))
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
