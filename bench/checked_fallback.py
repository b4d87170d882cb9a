"""Checked fallback on a real model: how often a request served in checked mode ends without a
valid output after its attempts.

    python -m bench.checked_fallback --target smollm2-135m-instruct --schemas ../shared/data/maskbench \\
        --n 50 --max-tokens 256 [--temperature 1.0] [--max-attempts N] [--concurrency 8]

Schemas: those the service serves only through checked mode (no engine enforces them exactly,
a relaxation does), picked by compiling each candidate in-process through the service's own
engine selection with the target's tokenizer (``bench.coverage.Checker``), in a seeded order
over all maskbench subsets, until ``--n`` are found. Each gets one chat request (the schema in
the system turn, as ``bench.e2e --chat``) through the local stack, sampled (a greedy request
makes one attempt: a resample would repeat it), seeded, with the server's defaults for the
fallback (``checked`` unset: ``--grammar-fallback checked``) and for ``max_attempts`` unless
given.

Outcomes per request:

* ``valid``: complete, and an independent ``jsonschema`` judge (``validate_decimal``) passes it;
* ``invalid_accepted``: complete but the judge fails it: a lie (goal 0);
* ``exhausted``: every attempt failed the end check (``GRAMMAR_VIOLATION``): the figure the
  goal bounds (failed after its attempts / checked requests);
* ``truncated``: ``max_tokens`` ran out first (``LENGTH``): not complete, not checked;
* ``not_checked``: served exact (the selection and the server disagree), ``refused``, ``errors``.

The last line is ``RESULT {json}``: counts, attempts per checked request, and the exhausted
schemas with the last end-check reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import jsonschema

from bench.coverage import Checker
from specmask.mask_service.grammar.schema_relax import RELAXATIONS
from specmask.orchestrator.chat import DEFAULT_INSTRUCTION_NAME
from specmask.orchestrator.client import build_request
from specmask.orchestrator.output_check import validate_decimal
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# The user turn; the schema goes into the system turn with the server's instruction (bench.e2e).
USER_TURN = "Generate a JSON object that matches the schema."
REQUEST_TIMEOUT_S = 1800.0
OUTCOMES = ("valid", "invalid_accepted", "exhausted", "truncated", "not_checked", "refused", "errors")


def candidates(directory: Path, seed: int) -> list[tuple[str, Any]]:
    """(name, schema) of every file whose schema names a keyword checked mode relaxes, seeded order."""
    out = []
    for path in sorted(directory.glob("*.json")):
        doc = json.loads(path.read_text())
        schema = doc["schema"] if isinstance(doc, dict) and "schema" in doc else doc
        text = json.dumps(schema)
        if any(f'"{keyword}"' in text for keyword in RELAXATIONS):
            out.append((path.stem, schema))
    random.Random(seed).shuffle(out)
    return out


def select(tokenizer_dir: str, pool: list[tuple[str, Any]], n: int) -> list[tuple[str, Any, tuple[str, ...]]]:
    """The first ``n`` of ``pool`` the service serves only in checked mode, with the rules relaxed."""
    from specmask.mask_service.errors import MaskError

    checker = Checker(tokenizer_dir, "auto", strict=True, checked=True)
    chosen: list[tuple[str, Any, tuple[str, ...]]] = []
    for name, schema in pool:
        if len(chosen) >= n:
            break
        try:
            selected = checker.compile(schema)
        except MaskError:
            continue
        if getattr(selected, "enforcement", "exact") == "checked":
            chosen.append((name, schema, tuple(selected.relaxed)))
    return chosen


async def _one(
    stub: pb_grpc.OrchestratorServiceStub,
    index: int,
    name: str,
    schema: Any,
    args: argparse.Namespace,
    gate: asyncio.Semaphore,
    tally: Counter[str],
    attempts: Counter[int],
    notes: list[str],
) -> None:
    req = build_request(
        [{"role": "user", "content": USER_TURN}],
        schema=schema,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed + index,
        request_id=f"checked-{index}",
        schema_instruction=DEFAULT_INSTRUCTION_NAME,
    )
    if args.max_attempts is not None:
        req.grammar.max_attempts = args.max_attempts
    async with gate:
        try:
            rsp = await stub.Generate(req, timeout=REQUEST_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            outcome = "refused" if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else "errors"
            tally[outcome] += 1
            notes.append(f"{name}: {outcome}: {exc.code().name}: {exc.details()[:200]}")
            return
    # One line per request as it ends: a run cut short still says what it measured.
    print(
        f"done {name}: {pb.FinishReason.Name(rsp.finish_reason)} {pb.Enforcement.Name(rsp.grammar.enforcement)} "
        f"attempts={rsp.grammar.attempts}",
        flush=True,
    )
    if rsp.grammar.enforcement != pb.ENFORCEMENT_CHECKED:
        tally["not_checked"] += 1
        notes.append(f"{name}: enforcement {pb.Enforcement.Name(rsp.grammar.enforcement)}")
        return
    attempts[rsp.grammar.attempts] += 1
    if rsp.finish_reason == pb.FINISH_REASON_GRAMMAR_VIOLATION:
        tally["exhausted"] += 1
        notes.append(f"{name}: exhausted after {rsp.grammar.attempts}: {rsp.error[:300]}")
    elif rsp.finish_reason == pb.FINISH_REASON_LENGTH:
        tally["truncated"] += 1
    elif rsp.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE:
        try:
            validate_decimal(json.loads(rsp.text), schema)
            tally["valid"] += 1
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
            tally["invalid_accepted"] += 1
            notes.append(f"LIE {name}: {str(exc).splitlines()[0][:200]}: {rsp.text[:200]}")
    else:
        tally["errors"] += 1
        notes.append(f"{name}: finish {pb.FinishReason.Name(rsp.finish_reason)}: {rsp.error[:200]}")


async def run(args: argparse.Namespace, target: str, chosen: list[tuple[str, Any, tuple[str, ...]]]) -> dict[str, Any]:
    from specmask.orchestrator.dev.local_stack import StackConfig, running_stack

    tally: Counter[str] = Counter()
    attempts: Counter[int] = Counter()
    notes: list[str] = []
    stack = StackConfig(target_dir=target, draft_dir=None)
    async with running_stack(stack, max_queue=max(256, 2 * len(chosen)), max_batch=args.concurrency) as running:
        gate = asyncio.Semaphore(args.concurrency)
        t0 = time.perf_counter()
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = pb_grpc.OrchestratorServiceStub(channel)
            await asyncio.gather(
                *(
                    _one(stub, i, name, schema, args, gate, tally, attempts, notes)
                    for i, (name, schema, _) in enumerate(chosen)
                )
            )
        seconds = time.perf_counter() - t0
    checked = sum(attempts.values())
    return {
        "requests": len(chosen),
        **{k: tally[k] for k in OUTCOMES},
        "checked": checked,
        "exhausted_rate": round(tally["exhausted"] / checked, 4) if checked else None,
        "attempts": {str(k): v for k, v in sorted(attempts.items())},
        "relaxed": dict(Counter(rule for _, _, rules in chosen for rule in rules).most_common()),
        "seconds": round(seconds, 1),
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="model dir or registered name")
    ap.add_argument("--schemas", required=True, help="maskbench-style directory")
    ap.add_argument("--n", type=int, default=50, help="schemas served only in checked mode to send")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-attempts", type=int, default=None, help="unset: the server's default")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="schema order and request seeds")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from specmask.gpu_worker.models.resolve import resolve_cli_models

    target, _ = resolve_cli_models(args.target, None, toy=False, progress=False)
    t0 = time.perf_counter()
    chosen = select(target, candidates(Path(args.schemas), args.seed), args.n)
    print(f"selected {len(chosen)} schemas served only in checked mode ({time.perf_counter() - t0:.0f}s)", flush=True)
    result = asyncio.run(run(args, target, chosen))
    for note in result["notes"]:
        print(note)
    result["schemas"] = [name for name, _, _ in chosen]
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
