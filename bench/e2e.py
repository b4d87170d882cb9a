"""End-to-end benchmark: schema-constrained requests through the whole stack.

    python -m bench.e2e --schemas toy --n 64                  # in-distribution for the toy pair
    python -m bench.e2e --schemas tests/data/maskbench       # real schemas the toy pair never saw
    python -m bench.e2e --target smollm2-135m-instruct --schemas ../shared/data/maskbench \
        --subsets Github_easy,Snowplow --n 4 --chat         # a real model, N schemas per subset

``--target`` is a model dir or a registered name (``specmask models list``; fetched on first
use). ``--chat`` sends chat messages (the model's chat template, the schema in the system turn,
JSONSchemaBench style) instead of the toy prompt. ``--subsets`` picks schema files by name prefix
(``Github_easy---o1.json`` -> ``Github_easy``, ``JME_3.json`` -> ``JME``); with it, ``--n`` is
schemas per subset (spread evenly over the sorted files) and RESULT carries the same counts per
subset under ``subsets``. ``coverage`` = valid / requests (JSONSchemaBench's empirical coverage:
refused, truncated and errored requests count against it).

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
* ``constrained-nospec``: grammar on, speculation off;
* ``constrained-forced-ngram``: grammar on, speculation with grammar-forced and n-gram
  drafts only (the draftless default), so a draft model is compared with the free
  proposers in the same run;
* ``constrained-all-proposers``: grammar on, every proposer: grammar-forced tokens, the
  n-gram lookup, and the draft model at the positions neither fills.

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
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import jsonschema

from specmask.common.proposer_kind import ProposerKind
from specmask.orchestrator.chat import DEFAULT_INSTRUCTION_NAME, schema_instruction
from specmask.orchestrator.client import StreamedResult, build_request, stream_retrying_overload
from specmask.orchestrator.dev.local_stack import RunningStack, StackConfig, running_stack
from specmask.orchestrator.output_check import validate_decimal
from specmask.orchestrator.types import Usage
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2_grpc as pb_grpc

REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Case:
    name: str
    schema: Any  # parsed JSON Schema
    prompt: str | list[dict[str, str]]  # text, or chat messages (--chat)
    subset: str = ""  # file-name prefix (maskbench subset)


# The user turn of --chat requests; the schema itself goes in with the server's default
# instruction (specmask/orchestrator/chat.py), as JSONSchemaBench prompts do.
CHAT_USER_TURN = "Generate a JSON object that matches the schema."
OUTCOMES = ("requests", "valid", "invalid", "truncated", "refused", "errors")


def subset_of(stem: str) -> str:
    """``Github_easy---o1`` -> ``Github_easy``; ``JME_3`` / ``BFCL_simple_12`` -> ``JME`` / ``BFCL_simple``."""
    if "---" in stem:
        return stem.split("---", 1)[0]
    head, _, tail = stem.rpartition("_")
    return head if head and tail.isdigit() else stem


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
    subsets: dict[str, dict[str, int]] = field(default_factory=dict)  # subset -> OUTCOMES counts
    outputs: dict[int, tuple[int, ...]] = field(default_factory=dict)  # case index -> token ids (finished)
    mask_calls: int = 0  # DraftMasks calls the mask replicas served during the phase (their /metrics)
    # Draft position (1-based) -> steps that verified it after accepting every earlier one, and
    # steps that accepted it (the server's specmask_draft_position_* counters over the phase).
    positions_reached: dict[int, int] = field(default_factory=dict)
    positions_accepted: dict[int, int] = field(default_factory=dict)

    def count(self, case: Case, outcome: str) -> None:
        """One request's outcome, overall and in its subset."""
        setattr(self, outcome, getattr(self, outcome) + 1)
        self.subsets.setdefault(case.subset, dict.fromkeys(OUTCOMES, 0))[outcome] += 1

    @property
    def tokens_per_s(self) -> float:
        return self.usage.completion_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def mean_step_ms(self) -> float:
        return 1000 * self.step_s / self.steps if self.steps else 0.0

    @property
    def mask_round_trips_per_step(self) -> float:
        return self.mask_calls / self.steps if self.steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P[draft i accepted | drafts 1..i-1 accepted], i = 1.. (positions some step reached)."""
        return [
            round(self.positions_accepted.get(i, 0) / self.positions_reached[i], 3)
            for i in sorted(self.positions_reached)
            if self.positions_reached[i]
        ]

    @property
    def mean_batch(self) -> float:
        return self.sequence_steps / self.steps if self.steps else 0.0


TOY_SCHEMAS = "toy"


def load_cases(
    schemas: str, n: int | None, *, chat: bool = False, subsets: tuple[str, ...] | None = None
) -> list[Case]:
    """``--schemas toy``: the toy pair's own schemas (in-distribution prompts). Otherwise a dir of
    ``*.json`` files: a bare JSON Schema, or a JSONSchemaBench record with a "schema" key.
    With ``subsets``: only files of those prefixes, ``n`` per subset, spread over the sorted files."""
    from specmask.gpu_worker.toy.schemas import all_schemas, prompt_for

    def prompt(name: str, schema: Any) -> str | list[dict[str, str]]:
        return [{"role": "user", "content": CHAT_USER_TURN}] if chat else prompt_for(name, schema)

    cases = []
    if schemas == TOY_SCHEMAS:
        cases = [Case(name, schema, prompt(name, schema), "toy") for name, schema in all_schemas().items()]
    else:
        paths = sorted(Path(schemas).glob("*.json"))
        if subsets is not None:
            by_subset = {s: [p for p in paths if subset_of(p.stem) == s] for s in subsets}
            empty = [s for s, ps in by_subset.items() if not ps]
            if empty:
                raise SystemExit(f"no schemas of subset(s) {empty} in {schemas}")
            take = n or 1
            paths = [ps[(i * len(ps)) // take] for ps in by_subset.values() for i in range(min(take, len(ps)))]
        for path in paths:
            doc = json.loads(path.read_text())
            schema = doc["schema"] if isinstance(doc, dict) and "schema" in doc and "tests" in doc else doc
            cases.append(Case(path.stem, schema, prompt(path.stem, schema), subset_of(path.stem)))
    if not cases:
        raise SystemExit(f"no *.json schemas in {schemas}")
    if n is not None and subsets is None:
        if n < len(cases):
            # Spread over the sorted files, not the first n: maskbench sorts by subset, so the
            # first 60 files would all be BFCL.
            cases = [cases[(i * len(cases)) // n] for i in range(n)]
        else:
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
    k: int | None,
    gate: asyncio.Semaphore,
    lengths: list[int],
    proposers: tuple[str, ...] | None = None,
) -> None:
    stats.subsets.setdefault(case.subset, dict.fromkeys(OUTCOMES, 0))["requests"] += 1
    prompt = case.prompt
    if not constrained and not isinstance(prompt, str):
        # No grammar means no server-side schema instruction: send the same system turn
        # ourselves, so both phases decode the same prompt.
        prompt = [{"role": "system", "content": schema_instruction(json.dumps(case.schema))}, *prompt]
    req = build_request(
        prompt,
        schema=case.schema if constrained else None,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        temperature=0.0,
        speculation=speculation,
        draft_masking=draft_masking if speculation else None,
        k=k if speculation else None,
        request_id=f"{stats.phase}-{index}",
        # The schema in the system turn for both phases (the server adds it only on request).
        schema_instruction=DEFAULT_INSTRUCTION_NAME if constrained and not isinstance(prompt, str) else None,
    )
    if proposers is not None and speculation:
        from specmask.orchestrator.convert import PROPOSER_ENUMS

        req.speculation.proposers.extend(PROPOSER_ENUMS[p] for p in proposers)
    result = StreamedResult()
    async with gate:
        try:
            async for chunk in stream_retrying_overload(stub, req, timeout=REQUEST_TIMEOUT_S):
                result.add(chunk)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                stats.count(case, "refused")
            else:
                stats.count(case, "errors")
                stats.error_samples.append(f"{case.name}: {exc.code().name}: {exc.details()}")
            return
    usage = result.usage or pb.Usage()
    lengths[index] = usage.completion_tokens
    stats.outputs[index] = tuple(result.token_ids)
    stats.usage.completion_tokens += usage.completion_tokens
    stats.usage.target_forwards += usage.target_forwards
    stats.usage.drafts_proposed += usage.drafts_proposed
    stats.usage.drafts_accepted += usage.drafts_accepted
    if result.finish_reason in (pb.FINISH_REASON_ERROR, pb.FINISH_REASON_GRAMMAR_VIOLATION):
        stats.count(case, "errors")
        stats.error_samples.append(f"{case.name}: finish {result.finish_reason_name}: {result.error}")
    elif result.finish_reason == pb.FINISH_REASON_LENGTH:
        stats.count(case, "truncated")
    elif constrained:
        try:
            # An independent judge (not the server's end check), but with multipleOf in decimal:
            # jsonschema's float division calls 10000.89 no multiple of 0.01.
            validate_decimal(json.loads(result.text), case.schema)
            stats.count(case, "valid")
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
            stats.count(case, "invalid")
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
    k: int | None = None,
    proposers: tuple[str, ...] | None = None,
) -> tuple[PhaseStats, list[int]]:
    """Run one phase; ``max_tokens`` per request (a list) means exactly that many (ignore_eos)."""
    stats = PhaseStats(phase=phase, requests=len(cases))
    exact = isinstance(max_tokens, list)
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(cases)
    lengths = [0] * len(cases)
    metrics = running.server.metrics
    steps0, step_s0, seqs0 = metrics.step_totals()
    reached0, accepted0 = metrics.position_totals()
    calls0 = await asyncio.to_thread(mask_call_count, running)
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
                    k=k,
                    gate=gate,
                    lengths=lengths,
                    proposers=proposers,
                )
                for i, c in enumerate(cases)
            )
        )
        stats.wall_s = time.monotonic() - started
    steps1, step_s1, seqs1 = metrics.step_totals()
    stats.steps, stats.step_s, stats.sequence_steps = steps1 - steps0, step_s1 - step_s0, seqs1 - seqs0
    reached1, accepted1 = metrics.position_totals()
    stats.positions_reached = {i: n - reached0.get(i, 0) for i, n in reached1.items()}
    stats.positions_accepted = {i: n - accepted0.get(i, 0) for i, n in accepted1.items()}
    stats.mask_calls = await asyncio.to_thread(mask_call_count, running) - calls0
    return stats, lengths


# A DraftMasks call is one mask round trip of a worker step; each replica counts the calls it served.
_DRAFT_CALLS_METRIC = "specmask_mask_draft_call_seconds_count"


def mask_call_count(running: RunningStack) -> int:
    """DraftMasks calls served so far by every replica of the stack (0 without /metrics)."""
    import urllib.request

    total = 0
    for proc in running.mask_services:
        if proc.metrics_port is None:
            continue
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(_DRAFT_CALLS_METRIC + " "):
                    total += int(float(line.split()[1]))
    return total


def identical_outputs(a: PhaseStats, b: PhaseStats) -> tuple[int, int]:
    """(requests whose token ids are the same in both phases, requests finished in both)."""
    both = a.outputs.keys() & b.outputs.keys()
    return sum(a.outputs[i] == b.outputs[i] for i in both), len(both)


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


PHASES = (
    "constrained",
    "unconstrained",
    "constrained-nodraftmask",
    "constrained-nospec",
    "constrained-forced-ngram",
    "constrained-all-proposers",
)
# The proposers of the constrained-forced-ngram phase (orchestrator.validation.DRAFTLESS_PROPOSERS).
FORCED_NGRAM = (ProposerKind.GRAMMAR_FORCED, ProposerKind.NGRAM)
# Every proposer: grammar-forced tokens, then n-gram lookup, the draft model where neither has one.
ALL_PROPOSERS = (ProposerKind.DRAFT_MODEL, ProposerKind.GRAMMAR_FORCED, ProposerKind.NGRAM)
# The constrained phases besides "constrained" itself: what each changes in the requests.
CONSTRAINED_VARIANTS: dict[str, dict[str, Any]] = {
    "constrained-nodraftmask": {"draft_masking": False},
    "constrained-nospec": {"speculation": False},
    "constrained-forced-ngram": {"proposers": FORCED_NGRAM},
    "constrained-all-proposers": {"proposers": ALL_PROPOSERS},
}


def print_subsets(stats: PhaseStats) -> None:
    """Per-subset outcomes of the constrained phase; coverage = valid / requests."""
    if len(stats.subsets) < 2:
        return
    width = max(len(s) for s in stats.subsets)
    print(f"\n{'subset':<{width}}  " + "  ".join(f"{c:>9}" for c in (*OUTCOMES, "coverage")))
    for name, counts in sorted(stats.subsets.items()):
        cov = counts["valid"] / counts["requests"] if counts["requests"] else 0.0
        print(f"{name:<{width}}  " + "  ".join(f"{counts[c]:>9}" for c in OUTCOMES) + f"  {cov:>9.0%}")


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
            "mask_calls",
        ):
            setattr(total, name, getattr(total, name) + getattr(r, name))
        for name in ("completion_tokens", "target_forwards", "drafts_proposed", "drafts_accepted"):
            setattr(total.usage, name, getattr(total.usage, name) + getattr(r.usage, name))
        total.error_samples += r.error_samples
        for summed, theirs in (
            (total.positions_reached, r.positions_reached),
            (total.positions_accepted, r.positions_accepted),
        ):
            for i, n in theirs.items():
                summed[i] = summed.get(i, 0) + n
        for subset, counts in r.subsets.items():
            mine = total.subsets.setdefault(subset, dict.fromkeys(OUTCOMES, 0))
            for k, v in counts.items():
                mine[k] += v
    return total


async def run_round(running: RunningStack, cases: list[Case], args: argparse.Namespace) -> dict[str, PhaseStats]:
    """The phases back to back; the unconstrained one replays the constrained lengths.
    A phase left out of ``--phases`` is skipped (the ratios that need it are then null)."""
    common: dict[str, Any] = {"concurrency": args.concurrency, "k": args.k}
    out: dict[str, PhaseStats] = {}
    out["constrained"], lengths = await run_phase(
        running, cases, "constrained", constrained=True, max_tokens=args.max_tokens, **common
    )
    if "unconstrained" in args.phases:
        out["unconstrained"], _ = await run_phase(
            running, cases, "unconstrained", constrained=False, max_tokens=lengths, **common
        )
    for phase, options in CONSTRAINED_VARIANTS.items():
        if phase in args.phases:
            out[phase], _ = await run_phase(
                running, cases, phase, constrained=True, max_tokens=args.max_tokens, **options, **common
            )
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _median(values: list[float | None]) -> float | None:
    """The median; with an even count the mean of the middle two (never the larger alone,
    which would flatter a two-round ratio)."""
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


async def bench(args: argparse.Namespace, cases: list[Case], stack: StackConfig) -> dict[str, Any]:
    async with running_stack(
        stack, max_queue=max(256, 2 * len(cases)), max_batch=args.max_batch, step_timeout_s=args.step_timeout_s
    ) as running:
        # Warm-up: first steps pay for lazy init (allocator, kernels, grammar compiles).
        await run_phase(running, cases, "warmup", constrained=True, max_tokens=8, concurrency=args.concurrency)
        # Phases alternate round by round, so drift on a shared box hits all of them
        # alike; ratios are taken within a round and the median over rounds reported.
        rounds = [await run_round(running, cases, args) for _ in range(args.rounds)]
        device = running.server.info.device
    merged = {name: merge([r[name] for r in rounds]) for name in PHASES if name in rounds[0]}
    empty = PhaseStats(phase="skipped")
    constrained, unconstrained = merged["constrained"], merged.get("unconstrained", empty)
    nodraftmask, nospec = merged.get("constrained-nodraftmask", empty), merged.get("constrained-nospec", empty)
    print_table(list(merged.values()))
    print_subsets(constrained)

    def per_round(a: str, b: str, metric: str) -> list[float | None]:
        return [_ratio(getattr(r[a], metric), getattr(r[b], metric)) if a in r and b in r else None for r in rounds]

    step_ratios = per_round("constrained", "unconstrained", "mean_step_ms")
    nodraftmask_ratios = per_round("constrained-nodraftmask", "unconstrained", "mean_step_ms")
    speedups = per_round("constrained", "constrained-nospec", "tokens_per_s")
    vs_forced_ngram = per_round("constrained", "constrained-forced-ngram", "tokens_per_s")
    forced_ngram = merged.get("constrained-forced-ngram", empty)
    all_proposers = merged.get("constrained-all-proposers", empty)
    vs_all = per_round("constrained-all-proposers", "constrained-nospec", "tokens_per_s")
    same = [identical_outputs(r["constrained"], r["constrained-nospec"]) for r in rounds if "constrained-nospec" in r]
    return {
        "rounds": args.rounds,
        "requests": constrained.requests,
        "coverage": _ratio(constrained.valid, constrained.requests),
        "subsets": {
            name: {**counts, "coverage": _ratio(counts["valid"], counts["requests"])}
            for name, counts in sorted(constrained.subsets.items())
        },
        "valid": constrained.valid,
        "invalid": constrained.invalid,
        "truncated": constrained.truncated,
        "refused": constrained.refused,
        "errors": sum(p.errors for p in merged.values()),
        "tokens_per_target_forward": round(constrained.usage.tokens_per_target_forward, 3),
        "acceptance_rate": round(constrained.usage.acceptance_rate, 3),
        "acceptance_by_position": constrained.acceptance_by_position,
        "forced_ngram_acceptance_by_position": forced_ngram.acceptance_by_position,
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
        # Greedy: speculation must not change a token. [same, compared] summed over rounds.
        "spec_nonspec_identical_outputs": [sum(s for s, _ in same), sum(n for _, n in same)] if same else None,
        "forced_ngram_tokens_per_target_forward": round(forced_ngram.usage.tokens_per_target_forward, 3),
        "forced_ngram_tokens_per_s": round(forced_ngram.tokens_per_s, 1),
        "spec_vs_forced_ngram_speedup": _median(vs_forced_ngram),
        "spec_vs_forced_ngram_speedup_rounds": vs_forced_ngram,
        "all_proposers_tokens_per_target_forward": round(all_proposers.usage.tokens_per_target_forward, 3),
        "all_proposers_tokens_per_s": round(all_proposers.tokens_per_s, 1),
        "all_proposers_acceptance_by_position": all_proposers.acceptance_by_position,
        "all_proposers_vs_nonspec_speedup": _median(vs_all),
        "all_proposers_vs_nonspec_speedup_rounds": vs_all,
        "mask_round_trips_per_step": round(constrained.mask_round_trips_per_step, 3),
        "nospec_mask_round_trips_per_step": round(nospec.mask_round_trips_per_step, 3),
        "device": device,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--schemas",
        required=True,
        help="dir of *.json schemas (bare or JSONSchemaBench), or 'toy' for the toy pair's schemas",
    )
    parser.add_argument(
        "--n",
        type=int,
        default=None,
        help="requests: n schemas spread over the sorted files, or cycling through them when fewer (default: one each)",
    )
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--max-batch", type=int, default=64, help="active sequences per worker")
    parser.add_argument("--rounds", type=int, default=3, help="times the phases run, alternating")
    parser.add_argument("--k", type=int, default=None, help="drafts per step when speculating (default: the server's)")
    parser.add_argument("--target", default=None, help="target model dir or registered name (default: the toy pair)")
    parser.add_argument("--draft", default=None, help="draft model dir or name ('none' = no draft model)")
    parser.add_argument(
        "--step-timeout-s",
        type=float,
        default=120.0,
        help="orchestrator step timeout (raise it for a real model on a slow CPU: long schema prompts prefill slowly)",
    )
    parser.add_argument("--chat", action="store_true", help="chat prompts with the schema in the system turn")
    parser.add_argument("--subsets", default=None, help="comma list of schema-file prefixes; --n is then per subset")
    parser.add_argument(
        "--phases",
        default=",".join(PHASES[1:4]),
        help=f"phases besides 'constrained' (comma list of {', '.join(PHASES[1:])})",
    )
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    args.phases = tuple(p for p in args.phases.split(",") if p)
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown:
        parser.error(f"unknown phases {unknown}")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    subsets = tuple(s for s in args.subsets.split(",") if s) if args.subsets else None
    cases = load_cases(args.schemas, args.n, chat=args.chat, subsets=subsets)
    from specmask.gpu_worker.models.resolve import resolve_cli_models

    target, draft = resolve_cli_models(args.target, args.draft, toy=args.target is None, progress=False)
    result = asyncio.run(bench(args, cases, StackConfig(target_dir=target, draft_dir=draft, mask_metrics=True)))
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
