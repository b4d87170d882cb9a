"""`specmask generate`: send one request to an orchestrator and print the output.

    specmask generate --address 127.0.0.1:50051 --schema user.json --prompt "A user:" --stream

The text goes to stdout (streamed as it arrives with --stream); the finish
reason and speculation stats go to stderr. Exit status: 0 on success, 1 when
the request failed (RPC error or finish reason ERROR), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc

from specmask.orchestrator.client import FINISH_REASON_NAMES, OrchestratorClient, StreamedResult, build_request
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="127.0.0.1:50051", help="orchestrator host:port")
    parser.add_argument("--prompt", required=True, help="prompt text")
    grammar = parser.add_mutually_exclusive_group()
    grammar.add_argument("--schema", type=Path, help="JSON Schema file constraining the output")
    grammar.add_argument("--regex", help="regular expression constraining the output")
    grammar.add_argument("--any-json", action="store_true", help="constrain to any JSON value")
    parser.add_argument("--backend", default="", help="grammar engine: auto (default), xgrammar or llguidance")
    parser.add_argument(
        "--checked",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="JSON Schema no engine enforces exactly: --checked = a relaxation, the output checked at the end "
        "and resampled; --no-checked = refuse rather than relax; neither = the server's --grammar-fallback",
    )
    parser.add_argument("--max-attempts", type=int, default=None, help="checked mode: generations to try")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (1 = off, the default)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="a seeded request reproduces its output exactly")
    parser.add_argument("--max-tokens", type=int, default=None, help="output budget (default: the server's)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--k", type=int, default=None, help="drafts per step (default: the server's)")
    parser.add_argument("--no-speculation", action="store_true", help="plain (constrained) decoding")
    parser.add_argument("--no-draft-masking", action="store_true", help="do not mask draft logits with the grammar")
    parser.add_argument(
        "--request-id",
        default="",
        help="id echoed back and carried by the server's log lines (default: the server picks one)",
    )
    parser.add_argument("--timeout-s", type=float, default=120.0, help="RPC deadline")
    parser.add_argument("--json", action="store_true", help="print the whole response as JSON on stdout")


def _print_stats(finish: str, error: str, usage: pb.Usage | None) -> None:
    line = f"finish_reason={finish}"
    if error:
        line += f" error={error!r}"
    if usage is not None:
        line += (
            f" prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}"
            f" target_forwards={usage.target_forwards} tokens/forward={usage.tokens_per_target_forward:.2f}"
            f" acceptance={usage.acceptance_rate:.2f} mask_time={usage.mask_time_s * 1000:.1f}ms"
        )
    print(line, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    try:
        schema = args.schema.read_text() if args.schema is not None else None
    except OSError as exc:
        print(f"cannot read schema: {exc}", file=sys.stderr)
        return 2
    req = build_request(
        args.prompt,
        schema=schema,
        regex=args.regex,
        any_json=args.any_json,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        speculation=False if args.no_speculation else None,
        k=args.k,
        draft_masking=False if args.no_draft_masking else None,
        request_id=args.request_id,
    )
    if args.backend or args.checked is not None or args.max_attempts is not None:
        req.grammar.backend = args.backend  # the server refuses these without a grammar (INVALID_ARGUMENT)
        if args.checked is not None:
            req.grammar.checked = args.checked
        if args.max_attempts is not None:
            req.grammar.max_attempts = args.max_attempts
    with OrchestratorClient(args.address) as client:
        try:
            if args.stream:
                result = StreamedResult()
                for chunk in client.stream(req, timeout_s=args.timeout_s):
                    result.add(chunk)
                    if not args.json:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                text, finish, error, usage = result.text, result.finish_reason, result.error, result.usage
                token_ids, request_id = result.token_ids, result.request_id
            else:
                resp = client.generate(req, timeout_s=args.timeout_s)
                text, finish, error, usage = resp.text, resp.finish_reason, resp.error, resp.usage
                token_ids, request_id = list(resp.token_ids), resp.request_id
                if not args.json:
                    sys.stdout.write(text)
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    finish_name = FINISH_REASON_NAMES.get(finish, str(finish))
    if args.json:
        usage_dict = {f.name: getattr(usage, f.name) for f in pb.Usage.DESCRIPTOR.fields} if usage is not None else {}
        print(
            json.dumps(
                {
                    "request_id": request_id,
                    "text": text,
                    "token_ids": token_ids,
                    "finish_reason": finish_name,
                    "error": error,
                    "usage": usage_dict,
                }
            )
        )
    else:
        sys.stdout.write("\n")
    _print_stats(finish_name, error, usage)
    return 1 if finish in (pb.FINISH_REASON_ERROR, pb.FINISH_REASON_GRAMMAR_VIOLATION) else 0
