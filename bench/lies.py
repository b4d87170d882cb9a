"""Lie hunter: random grammars and sampling through the real stack; no invalid output may pass.

    python -m bench.lies --requests 2000 [--seed 1] [--concurrency 32] [--max-tokens 48]

Brings up the local stack (mask service, Ray worker(s), orchestrator; the toy
pair unless --target/--draft), sends ``--requests`` seeded random requests
(bench.lie_cases: JSON Schemas with every option, regex/EBNF/Lark, recursive
grammars, extreme sampling parameters, every speculation setting) and checks
every *completed* output (GRAMMAR_COMPLETE or STOP) independently of the serving
path. Outcomes:

* ``completed``: reported complete; ``violations`` = completed outputs that fail
  the independent check (the lies; the goal is 0);
* ``caught``: finished GRAMMAR_VIOLATION (the server refused to lie: its device
  or end-of-request check caught an invalid output; not a lie, but a bug to chase);
* ``refused``: INVALID_ARGUMENT before generation (e.g. refused schema keywords);
* ``truncated``: LENGTH (not complete, not checked);
* ``overloaded``: RESOURCE_EXHAUSTED (typed back-pressure) even after retries;
* ``errors``: any other RPC status or finish ERROR.

Last line: ``RESULT {json}``; exit status 1 when violations > 0.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from bench.lie_cases import Case, generate
from specmask.orchestrator.client import StreamedResult
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 300.0
MAX_SAMPLES = 20  # failure descriptions kept per outcome
OVERLOAD_RETRIES = 6  # RESOURCE_EXHAUSTED answers retried (with backoff) before counting as overloaded

_COMPLETE = (pb.FINISH_REASON_GRAMMAR_COMPLETE, pb.FINISH_REASON_STOP)


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    violations: int = 0
    caught: int = 0
    refused: int = 0
    truncated: int = 0
    errors: int = 0
    overloaded: int = 0
    by_family: dict[str, collections.Counter] = field(default_factory=dict)
    samples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, outcome: str, case: Case, detail: str = "") -> None:
        self.requests += 1
        setattr(self, outcome, getattr(self, outcome) + 1)
        self.by_family.setdefault(case.name, collections.Counter())[outcome] += 1
        if outcome in ("violations", "caught", "errors", "overloaded"):
            kept = self.samples.setdefault(outcome, [])
            if len(kept) < MAX_SAMPLES:
                kept.append(f"{case.request.request_id}: {detail} || {case.description}")

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out["by_family"] = {k: dict(v) for k, v in sorted(self.by_family.items())}
        return out


async def _one(stub: pb_grpc.OrchestratorServiceStub, case: Case, tally: Tally, gate: asyncio.Semaphore) -> None:
    for attempt in range(OVERLOAD_RETRIES + 1):
        result = StreamedResult()
        async with gate:
            try:
                async for chunk in stub.GenerateStream(case.request, timeout=REQUEST_TIMEOUT_S):
                    result.add(chunk)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    tally.add("refused", case)
                    return
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    tally.add("errors", case, f"{exc.code().name}: {exc.details()}")
                    return
                if attempt == OVERLOAD_RETRIES:
                    tally.add("overloaded", case, f"{exc.code().name}: {exc.details()}")
                    return
        # Typed back-pressure (queue full, grammar compile queue busy): back off, retry.
        await asyncio.sleep(min(2.0**attempt, 16.0))
    reason = result.finish_reason
    if reason in _COMPLETE:
        problem = case.check(result.text)
        if problem is None:
            tally.add("completed", case)
        else:
            tally.completed += 1
            tally.add("violations", case, f"{problem}; text={result.text!r}")
    elif reason == pb.FINISH_REASON_GRAMMAR_VIOLATION:
        tally.add("caught", case, f"{result.error}; text={result.text!r}")
    elif reason == pb.FINISH_REASON_LENGTH:
        tally.add("truncated", case)
    elif "RESOURCE_EXHAUSTED" in result.error:
        # Back-pressure met after the stream began (the grammar was still compiling past its
        # wait on a loaded host): overload, not a failure of the request's grammar.
        tally.add("overloaded", case, f"finish {reason}: {result.error}")
    else:
        tally.add("errors", case, f"finish {reason}: {result.error}")


async def run_cases(address: str, cases: Sequence[Case], *, concurrency: int = 32, progress_every: int = 0) -> Tally:
    """Send every case to the orchestrator at ``address`` (at most ``concurrency`` at once);
    with ``progress_every``, log the running tally every that many requests."""
    tally = Tally()
    gate = asyncio.Semaphore(concurrency)
    started = time.monotonic()

    async def one(stub: pb_grpc.OrchestratorServiceStub, case: Case) -> None:
        await _one(stub, case, tally, gate)
        if progress_every and tally.requests % progress_every == 0:
            rate = tally.requests / (time.monotonic() - started)
            logger.warning(
                "%d/%d requests (%.2f/s): completed %d, violations %d, caught %d, refused %d, truncated %d, errors %d, "
                "overloaded %d",
                tally.requests,
                len(cases),
                rate,
                tally.completed,
                tally.violations,
                tally.caught,
                tally.refused,
                tally.truncated,
                tally.errors,
                tally.overloaded,
            )

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.OrchestratorServiceStub(channel)
        await asyncio.gather(*(one(stub, case) for case in cases))
    return tally


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from specmask.orchestrator.dev.local_stack import StackConfig, ensure_toy_models, running_stack

    if args.target is None:
        target, draft = ensure_toy_models(progress=False)
        draft = args.draft or draft
    else:
        target, draft = args.target, args.draft
    stack = StackConfig(target_dir=target, draft_dir=draft, num_workers=args.workers)
    async with running_stack(stack, max_queue=max(256, 2 * args.concurrency), max_batch=args.max_batch) as running:
        max_k = running.config.max_k
        cases = generate(args.seed, args.requests, max_k=max_k, max_tokens=args.max_tokens, unicode=args.unicode)
        started = time.monotonic()
        tally = await run_cases(
            running.address, cases, concurrency=args.concurrency, progress_every=args.progress_every
        )
        elapsed = time.monotonic() - started
    result = tally.summary()
    result.update(seed=args.seed, seconds=round(elapsed, 1), requests_per_s=round(tally.requests / elapsed, 2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unicode", action="store_true", help="non-ASCII grammars only (lie_cases.UNICODE_FAMILIES)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    parser.add_argument("--max-tokens", type=int, default=48, help="upper bound of the random max_tokens")
    parser.add_argument("--max-batch", type=int, default=32, help="active sequences per worker")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--target", default=None, help="target model dir (default: the toy pair)")
    parser.add_argument("--draft", default=None, help="draft model dir (default: the toy pair's)")
    parser.add_argument("--progress-every", type=int, default=100, help="log the tally every N requests (0 = off)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = asyncio.run(_bench(args))
    for outcome in ("violations", "caught", "errors", "overloaded"):
        for line in result["samples"].get(outcome, []):
            print(f"{outcome.upper()}: {line}")
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "samples"}, sort_keys=True))
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
