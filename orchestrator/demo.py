"""`specmask demo` (what `make demo` runs): the toy pair, the whole stack, a few requests.

1. Build the toy target/draft pair (first run only; cached in .specmask/toy-models).
2. Bring up a mask service, a local Ray worker and the orchestrator.
3. Stream a few schema-constrained requests one by one, then send a batch
   concurrently (continuous batching), and one schema the grammar engine
   refuses. Every output is checked with `jsonschema`.
4. Print speculation stats and shut everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass

import grpc
import jsonschema

from orchestrator.client import FINISH_REASON_NAMES, StreamedResult, build_request
from orchestrator.local_stack import StackConfig, ensure_toy_models, running_stack
from proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from proto.gen.specmask.orchestrator.v1 import orchestrator_pb2_grpc as pb_grpc

STREAMED = ("user", "product", "sensor_reading")  # two training schemas, one held out
BATCH = ("address", "order", "event", "task", "shipment", "library_loan", "recipe", "flight_booking")
# A schema the engine cannot enforce ('not'): refused with INVALID_ARGUMENT, never run unconstrained.
REFUSED_SCHEMA = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
# Enough for every toy document; a cut-off output would not be valid JSON.
MAX_TOKENS = 400
REQUEST_TIMEOUT_S = 300.0


@dataclass
class Outcome:
    name: str
    result: StreamedResult
    valid: bool  # completed and valid against its schema
    problem: str  # why not, when not valid
    seconds: float

    @property
    def truncated(self) -> bool:
        """Cut at max_tokens: the grammar guarantees validity only for completed documents."""
        return self.result.finish_reason == pb.FINISH_REASON_LENGTH


def _check(schema: dict, text: str) -> tuple[bool, str]:
    try:
        jsonschema.validate(json.loads(text), schema)
    except json.JSONDecodeError as exc:
        return False, f"not JSON ({exc.msg})"
    except jsonschema.ValidationError as exc:
        return False, f"schema violation: {exc.message}"
    return True, ""


def _schemas() -> dict[str, dict]:
    from gpu_worker.toy.schemas import all_schemas

    return all_schemas()


async def _generate(stub: pb_grpc.OrchestratorServiceStub, name: str, schema: dict, *, echo: bool) -> Outcome:
    from gpu_worker.toy.schemas import prompt_for

    req = build_request(prompt_for(name, schema), schema=schema, max_tokens=MAX_TOKENS, request_id=f"demo-{name}")
    result = StreamedResult()
    started = time.monotonic()
    async for chunk in stub.GenerateStream(req, timeout=REQUEST_TIMEOUT_S):
        result.add(chunk)
        if echo and chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    if result.finish_reason == pb.FINISH_REASON_LENGTH:
        valid, problem = False, f"cut at max_tokens={MAX_TOKENS} before the document closed"
    elif result.finish_reason == pb.FINISH_REASON_ERROR:
        valid, problem = False, f"error: {result.error}"
    else:
        valid, problem = _check(schema, result.text)
    return Outcome(name, result, valid, problem, time.monotonic() - started)


def _stats(o: Outcome) -> str:
    u = o.result.usage or pb.Usage()
    return (
        f"{u.completion_tokens:4d} tokens in {u.target_forwards:3d} target forwards "
        f"= {u.tokens_per_target_forward:4.2f} tokens/forward, acceptance {u.acceptance_rate:4.0%}, "
        f"{o.seconds:5.2f} s"
    )


def _mark(o: Outcome) -> str:
    return "OK " if o.valid else ("CUT" if o.truncated else "BAD")


def _verdict(o: Outcome) -> str:
    finish = FINISH_REASON_NAMES.get(o.result.finish_reason, "?")
    return ("valid JSON for its schema" if o.valid else o.problem) + f" (finish: {finish})"


async def _demo(stack: StackConfig) -> int:
    schemas = _schemas()
    print("Starting the stack: mask service, Ray worker, orchestrator ...", flush=True)
    async with running_stack(stack) as running:
        print(
            f"Stack is up: orchestrator at {running.address}, mask service at {running.mask_services[0].address}.\n",
            flush=True,
        )
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = pb_grpc.OrchestratorServiceStub(channel)
            outcomes: list[Outcome] = []

            print("== Streamed, one at a time " + "=" * 50)
            for name in STREAMED:
                print(f"\n[{name}] prompt: {json.dumps(_prompt(name))}")
                print("  -> ", end="", flush=True)
                o = await _generate(stub, name, schemas[name], echo=True)
                print(f"\n  {_mark(o)} {_verdict(o)}\n      {_stats(o)}")
                outcomes.append(o)

            print(f"\n== {len(BATCH)} requests at once (continuous batching) " + "=" * 30)
            started = time.monotonic()
            batch = await asyncio.gather(*(_generate(stub, n, schemas[n], echo=False) for n in BATCH))
            wall = time.monotonic() - started
            width = max(len(n) for n in BATCH)
            for o in batch:
                print(f"  {_mark(o)} {o.name:<{width}}  {_stats(o)}")
                print(f"      {o.result.text[:110]}{'...' if len(o.result.text) > 110 else ''}")
            tokens = sum((o.result.usage or pb.Usage()).completion_tokens for o in batch)
            print(f"  batch: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tokens/s")
            outcomes.extend(batch)

            print("\n== A schema the grammar engine cannot enforce " + "=" * 30)
            try:
                await stub.Generate(build_request("x", schema=REFUSED_SCHEMA), timeout=30)
                print("  UNEXPECTED: the request was accepted")
                refused_ok = False
            except grpc.aio.AioRpcError as exc:
                print(f"  refused before any GPU work: {exc.code().name}: {exc.details()}")
                refused_ok = exc.code() == grpc.StatusCode.INVALID_ARGUMENT

    usages = [o.result.usage or pb.Usage() for o in outcomes]
    produced = sum(u.completion_tokens for u in usages)
    forwards = sum(u.target_forwards for u in usages)
    proposed = sum(u.drafts_proposed for u in usages)
    accepted = sum(u.drafts_accepted for u in usages)
    valid = sum(o.valid for o in outcomes)
    truncated = sum(o.truncated for o in outcomes)
    bad = len(outcomes) - valid - truncated
    print("\n== Summary " + "=" * 66)
    print(
        f"  completed outputs valid against their schema: {valid}/{valid + bad}"
        + (f"  ({truncated} cut at max_tokens: the toy model loops on a schema it never saw)" if truncated else "")
    )
    print(
        f"  tokens per target forward:          {produced / max(forwards, 1):.2f}  "
        f"({produced} tokens / {forwards} forwards; 1.00 = no speculation gain)"
    )
    print(f"  draft acceptance:                   {accepted / max(proposed, 1):.0%}  ({accepted}/{proposed} drafts)")
    print("Stack stopped.")
    # Failure = a completed output that does not validate, an error, or a missed refusal.
    return 0 if bad == 0 and refused_ok else 1


def _prompt(name: str) -> str:
    from gpu_worker.toy.schemas import prompt_for

    return prompt_for(name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, metavar="DIR", help="target model dir (default: the toy pair)")
    parser.add_argument("--draft", default=None, metavar="DIR", help="draft model dir (default: the toy pair's)")
    parser.add_argument("--log-level", default="WARNING", help="server-side logging (default: quiet)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.target is None:
        print("Building the toy model pair (first run trains it, ~2 min on 2 cores; then cached) ...", flush=True)
        target, draft = ensure_toy_models()
        print(f"  target: {target}\n  draft:  {draft}", flush=True)
    else:
        target, draft = args.target, args.draft
    stack = StackConfig(target_dir=target, draft_dir=draft, log_dir=".specmask/logs", worker_logs=False)
    return asyncio.run(_demo(stack))
