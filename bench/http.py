"""HTTP (OpenAI-compatible) vs gRPC overhead on the same stack: time to first token and per-token latency.

    python -m bench.http                       # the tiny random-init pair, 1 and 32 streams
    python -m bench.http --target DIR --draft DIR --rounds 5

Brings up the local stack (one mask service, one worker, the orchestrator with
both APIs), then runs the clients in a separate process (so client work does
not share the server's event loop). Every request is the same: the same text
prompt, greedy, ``ignore_eos`` with a fixed ``max_tokens``, no grammar, so both
APIs step identical batches and differ only in the front door. gRPC streams
``GenerateStream``; HTTP streams ``/v1/completions`` (SSE, raw aiohttp client,
``include_usage`` for the token count). Phases alternate API within each round
so drift on a shared machine hits both alike. Server CPU per token: the
orchestrator process's CPU time (all its threads, /proc/PID/task/*/schedstat) over a phase,
divided by the tokens it streamed: the front door's cost without the noise of
latency on a shared machine (the worker runs in its own Ray process); client
CPU per token likewise for the client process (its cost competes for the same
cores when client, server and worker share a machine).

Per stream: TTFT = first non-empty delta - send; per-token latency = (last
delta - first delta) / (completion tokens - 1). Each API keeps one warm
connection (gRPC channel, HTTP keep-alive pool) across phases. The
table shows medians over streams and rounds; ``http_vs_grpc_per_token`` is the
median over rounds of the per-round ratio of median per-token latency (goal:
<= 1.05). Prints the table and, last, ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT = "Generate JSON for schema user:\n"


# ---- client side (a separate process) --------------------------------------


async def _grpc_stream(stub: Any, max_tokens: int) -> tuple[float, float, int]:
    from specmask.orchestrator.client import build_request

    req = build_request(PROMPT, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sent = time.perf_counter()
    first = last = 0.0
    total = 0
    async for chunk in stub.GenerateStream(req, timeout=600):
        if chunk.token_ids:
            last = time.perf_counter()
            first = first or last
            total += len(chunk.token_ids)
    return first - sent, last - first, total


async def _http_stream(session: Any, url: str, model: str, max_tokens: int) -> tuple[float, float, int]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = 0.0
    total = 0
    async with session.post(f"{url}/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                total = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    return first - sent, last - first, total


async def _http_stream_raw(url: str, model: str, max_tokens: int) -> tuple[float, float, int]:
    """The same stream over a bare asyncio connection (HTTP/1.1 by hand, no client library)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    body = json.dumps(
        {
            "model": model,
            "prompt": PROMPT,
            "temperature": 0.0,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    head = (
        f"POST {parts.path}/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    sent = time.perf_counter()
    writer.write(head + body)
    first = last = 0.0
    total = 0
    try:
        while True:
            line = await reader.readline()
            if not line:
                break
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                total = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    finally:
        writer.close()
    return first - sent, last - first, total


class Clients:
    """One gRPC channel and one HTTP connection pool, kept across phases (warm, like real clients)."""

    def __init__(self, args: argparse.Namespace, concurrency: int) -> None:
        import aiohttp
        import grpc

        from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2_grpc as pb_grpc

        self.args = args
        # One multiplexed HTTP/2 channel (how gRPC clients run), or one per stream
        # (--grpc-channel-per-stream: as many connections as the HTTP side has).
        n = concurrency if args.grpc_channel_per_stream else 1
        self.channels = [
            grpc.aio.insecure_channel(args.grpc, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(n)
        ]
        self.stubs = [pb_grpc.OrchestratorServiceStub(c) for c in self.channels]
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))

    async def phase(self, api: str, concurrency: int) -> dict[str, Any]:
        a = self.args
        cpu_before = _process_cpu_s(a.server_pid)
        client_before = time.process_time()
        if api == "grpc":
            stubs = self.stubs
            runs = await asyncio.gather(
                *(_grpc_stream(stubs[i % len(stubs)], a.max_tokens) for i in range(concurrency))
            )
        elif a.raw_http_client:
            runs = await asyncio.gather(*(_http_stream_raw(a.http, a.model, a.max_tokens) for _ in range(concurrency)))
        else:
            runs = await asyncio.gather(
                *(_http_stream(self.session, a.http, a.model, a.max_tokens) for _ in range(concurrency))
            )
        cpu = _process_cpu_s(a.server_pid) - cpu_before
        client_cpu = time.process_time() - client_before
        out = []
        for ttft, span, total in runs:
            if total != a.max_tokens:
                raise RuntimeError(f"{api}: a stream produced {total} tokens, expected {a.max_tokens}")
            # Greedy: both APIs emit the same deltas, so (total - 1) divides both alike.
            out.append((ttft, span / (total - 1)))
        tokens = concurrency * a.max_tokens
        return {
            "streams": out,
            "server_cpu_us_per_token": 1e6 * cpu / tokens,
            "client_cpu_us_per_token": 1e6 * client_cpu / tokens,
        }

    async def close(self) -> None:
        await self.session.close()
        for channel in self.channels:
            await channel.close()


def _process_cpu_s(pid: int) -> float:
    """CPU seconds the process's live threads have run so far (Linux schedstat, nanoseconds)."""
    total_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total_ns += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just exited
            continue
    return total_ns / 1e9


async def client_main(args: argparse.Namespace) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {}
    for concurrency in args.concurrency:
        clients = Clients(args, concurrency)
        try:
            for api in ("grpc", "http"):  # warm-up: connections, first steps at this batch size
                await clients.phase(api, concurrency)
            rounds[str(concurrency)] = []
            for r in range(args.rounds):
                order = ("grpc", "http") if r % 2 == 0 else ("http", "grpc")
                rounds[str(concurrency)].append({api: await clients.phase(api, concurrency) for api in order})
        finally:
            await clients.close()
    return rounds


# ---- driver ------------------------------------------------------------------


def _ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def summarise(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    header = f"{'streams':>7} {'api':>5} {'TTFT p50 ms':>12} {'per-token p50 ms':>17}"
    print(header + f" {'server CPU us/token':>20} {'client CPU us/token':>20}")
    for concurrency, per_round in rounds.items():
        row: dict[str, Any] = {}
        for api in ("grpc", "http"):
            ttft = [t for rnd in per_round for t, _ in rnd[api]["streams"]]
            tok = [p for rnd in per_round for _, p in rnd[api]["streams"]]
            cpu = statistics.median(rnd[api]["server_cpu_us_per_token"] for rnd in per_round)
            client = statistics.median(rnd[api]["client_cpu_us_per_token"] for rnd in per_round)
            row[api] = {
                "ttft_ms_p50": _ms(ttft),
                "per_token_ms_p50": _ms(tok),
                "server_cpu_us_per_token": cpu,
                "client_cpu_us_per_token": client,
            }
            print(f"{concurrency:>7} {api:>5} {_ms(ttft):>12.2f} {_ms(tok):>17.3f} {cpu:>20.1f} {client:>20.1f}")
        ratios = [
            _ratio(
                statistics.median(p for _, p in rnd["http"]["streams"]),
                statistics.median(p for _, p in rnd["grpc"]["streams"]),
            )
            for rnd in per_round
        ]
        ttft_ratios = [
            _ratio(
                statistics.median(t for t, _ in rnd["http"]["streams"]),
                statistics.median(t for t, _ in rnd["grpc"]["streams"]),
            )
            for rnd in per_round
        ]
        row["http_vs_grpc_per_token"] = statistics.median(ratios)
        row["http_vs_grpc_per_token_rounds"] = ratios
        row["http_vs_grpc_ttft"] = statistics.median(ttft_ratios)
        result[f"streams_{concurrency}"] = row
    for concurrency in rounds:
        row = result[f"streams_{concurrency}"]
        print(
            f"{concurrency} streams: HTTP/gRPC per-token {row['http_vs_grpc_per_token']:.3f} "
            f"(rounds {', '.join(f'{x:.3f}' for x in row['http_vs_grpc_per_token_rounds'])}), "
            f"TTFT {row['http_vs_grpc_ttft']:.3f}"
        )
    return result


def _ratio(a: float, b: float) -> float:
    """a / b, NaN when b is 0: with a small --max-tokens a stream can arrive in one chunk, so its
    per-token time is 0 (the run then says nan rather than dying after the measurement)."""
    return a / b if b > 0 else float("nan")


async def drive(args: argparse.Namespace) -> dict[str, Any]:
    if args.target is not None:
        return await _drive(args, args.target, args.draft)
    from tests.fixtures.tiny_models import build_tiny_model_pair

    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:  # removed with the run
        target, draft = build_tiny_model_pair(tmp)
        return await _drive(args, str(target), str(draft))


async def _drive(args: argparse.Namespace, target: str, draft: str | None) -> dict[str, Any]:
    from specmask.orchestrator.dev.local_stack import StackConfig, running_stack

    stack = StackConfig(target_dir=target, draft_dir=draft, mask_replicas=1, num_workers=1)
    overrides = {"http_port": 0, "max_batch": max(args.concurrency), "default_max_tokens": args.max_tokens}
    async with running_stack(stack, **overrides) as running:
        assert running.server.http is not None  # http_port is set above
        cmd = [sys.executable, "-m", "bench.http", "--client", "--grpc", running.address]
        cmd += ["--server-pid", str(os.getpid())]
        cmd += [
            "--http",
            f"http://127.0.0.1:{running.server.http_port}/v1",
            "--model",
            running.server.http.config.model_name,
        ]
        cmd += ["--rounds", str(args.rounds), "--max-tokens", str(args.max_tokens)]
        cmd += ["--concurrency", *map(str, args.concurrency)]
        cmd += ["--grpc-channel-per-stream"] if args.grpc_channel_per_stream else []
        cmd += ["--raw-http-client"] if args.raw_http_client else []
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"client process failed ({proc.returncode})")
    rounds = json.loads(out.decode().split("ROUNDS ", 1)[1])
    result = summarise(rounds)
    result.update(target=target, max_tokens=args.max_tokens, rounds=args.rounds)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="target model dir (default: the tiny random-init pair)")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--grpc-channel-per-stream", action="store_true", help="one gRPC channel (connection) per stream"
    )
    parser.add_argument(
        "--raw-http-client", action="store_true", help="HTTP over bare asyncio sockets instead of aiohttp's client"
    )
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--grpc", help=argparse.SUPPRESS)
    parser.add_argument("--http", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        print("ROUNDS " + json.dumps(asyncio.run(client_main(args))), flush=True)
        return 0
    result = asyncio.run(drive(args))
    print("RESULT " + json.dumps(_nan_to_null(result), sort_keys=True))
    return 0


def _nan_to_null(value: Any) -> Any:
    """The RESULT line stays strict JSON: a ratio that could not be taken (``_ratio``) is null."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _nan_to_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_null(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
