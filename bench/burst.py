"""A burst of long prompts against a steady stream: inter-token latency and time to first token.

    python -m bench.burst --target smollm2-135m-instruct --burst 32 --prompt-tokens 4000

A local stack (one mask-service replica, local Ray, one GPU worker, the orchestrator in this
process; 127.0.0.1 only) serves two clients:

* **steady**: one stream at a time, back to back (plain text, ``--stream-max-tokens`` each),
  measured alone first (``--baseline-s``), then while the burst is served;
* **burst**: ``--burst`` requests whose prompts are ``--prompt-tokens`` tokens each (distinct
  text, as schemas or tool lists in system prompts are), sent at once, each asking for
  ``--burst-max-tokens`` tokens.

The steady stream's inter-token latency (ITL) is the gap between consecutive chunks that
carry tokens (one per worker step; a chunk may hold several accepted drafts). The table
compares the burst phase with the baseline measured in the same run (the ratio is the
figure; absolute times depend on the box). The last line is ``RESULT {json}`` with
burst_errors, burst_ttft_p50/p99_s, itl_baseline_p50/p99_ms, itl_burst_p50/p99_ms,
itl_p99_ratio, steady_errors, worker_failures and the flags that shaped the run.
Without ``--target`` the tiny random-init pair (8k context) is used: the serving path,
not the model, is measured.

``--worker-only`` measures the same thing one level down, with no Ray, gRPC or mask
service: a ``GpuWorker`` in this process decodes the steady sequence (one token per
iteration, k=0), the burst is added in one ``add`` call, and each ``step()`` is one
iteration, so ITL is the iteration time and TTFT the time from the ``add`` to the burst
sequence's first token. It isolates the worker's scheduling (budget, chunked prefill)
from the serving path's overheads, and starts in seconds on a busy box.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.orchestrator.dev.local_stack import StackConfig, running_stack

STEADY_PROMPT = "Write a short story about a lighthouse keeper and a storm."


@dataclass
class StreamLog:
    """Chunk arrival times of the steady streams, and their errors."""

    arrivals: list[list[float]] = field(default_factory=list)  # per stream, times of token-carrying chunks
    errors: list[str] = field(default_factory=list)

    def gaps(self, lo: float, hi: float) -> list[float]:
        """Inter-token gaps (s) whose later chunk arrived in [lo, hi]."""
        return [gap for _, gap in self._timed_gaps(lo, hi)]

    def worst(self, lo: float, hi: float, n: int = 5) -> list[list[float]]:
        """The ``n`` longest gaps in [lo, hi] as [seconds after lo, gap ms]: where the tail sits."""
        gaps = sorted(self._timed_gaps(lo, hi), key=lambda g: -g[1])[:n]
        return [[round(at - lo, 1), round(1000 * gap, 1)] for at, gap in gaps]

    def _timed_gaps(self, lo: float, hi: float) -> list[tuple[float, float]]:
        """(arrival of the later chunk, gap) for every gap whose later chunk arrived in [lo, hi]."""
        return [(b, b - a) for times in self.arrivals for a, b in itertools.pairwise(times) if lo <= b <= hi]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def steady_loop(address: str, stop: threading.Event, log: StreamLog, max_tokens: int) -> None:
    with OrchestratorClient(address) as client:
        i = 0
        while not stop.is_set():
            times: list[float] = []
            log.arrivals.append(times)
            request = build_request(f"{STEADY_PROMPT} ({i})", max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            try:
                for chunk in client.stream(request, timeout_s=900):
                    if chunk.token_ids:
                        times.append(time.monotonic())
                    if chunk.error:
                        log.errors.append(chunk.error)
            except Exception as exc:  # counted, never hidden
                log.errors.append(repr(exc))
            i += 1


def burst_prompts(tokenizer_dir: str, n: int, tokens: int) -> list[list[int]]:
    """``n`` distinct prompts of exactly ``tokens`` token ids: real JSON-ish text, numbered."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    prompts = []
    for i in range(n):
        parts = [f"Request {i}. Answer in JSON following this schema."]
        ids: list[int] = []
        j = 0
        while len(ids) < tokens:
            parts.append(
                json.dumps({"title": f"field_{i}_{j}", "type": "object", "properties": {f"p{j}": {"type": "string"}}})
            )
            j += 1
            if j % 20 == 0:
                ids = tok.encode(" ".join(parts)).ids
        prompts.append(ids[:tokens])
    return prompts


def run_burst(address: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[str]]:
    """Send every prompt at once; per request its time to first token (s), and the errors."""
    ttfts: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(prompt: list[int]) -> None:
        start = time.monotonic()
        first: float | None = None
        try:
            with OrchestratorClient(address) as client:
                for chunk in client.stream(build_request(prompt, max_tokens=max_tokens), timeout_s=1800):
                    if chunk.token_ids and first is None:
                        first = time.monotonic() - start
                    if chunk.error:
                        with lock:
                            errors.append(chunk.error)
        except Exception as exc:
            with lock:
                errors.append(repr(exc))
        if first is not None:
            with lock:
                ttfts.append(first)

    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(one, prompts))
    return ttfts, errors


async def bench(args: argparse.Namespace, target: str, draft: str | None) -> dict[str, Any]:
    stack = StackConfig(target_dir=target, draft_dir=draft, num_workers=1, worker_logs=False)
    overrides: dict[str, Any] = dict(max_queue=max(256, 2 * args.burst), step_timeout_s=args.step_timeout_s)
    if args.max_iteration_tokens is not None:
        overrides["max_iteration_tokens"] = args.max_iteration_tokens
    if args.max_batch is not None:
        overrides["max_batch"] = args.max_batch
    if args.torch_threads:
        overrides["worker_torch_threads"] = args.torch_threads
    async with running_stack(stack, **overrides) as running:
        address = f"127.0.0.1:{running.port}"
        prompts = await asyncio.to_thread(burst_prompts, target, args.burst, args.prompt_tokens)
        log = StreamLog()
        stop = threading.Event()
        steady = threading.Thread(target=steady_loop, args=(address, stop, log, args.stream_max_tokens))
        steady.start()
        await asyncio.sleep(args.warmup_s)
        base_lo = time.monotonic()
        await asyncio.sleep(args.baseline_s)
        base_hi = burst_lo = time.monotonic()
        ttfts, burst_errors = await asyncio.to_thread(run_burst, address, prompts, args.burst_max_tokens)
        burst_hi = time.monotonic()
        stop.set()
        await asyncio.to_thread(steady.join, 900)
        metrics = running.server.metrics.registry
        failures = metrics.get_sample_value("specmask_worker_failures_total", {"worker": "0"}) or 0.0
        config = running.config
    base, during = log.gaps(base_lo, base_hi), log.gaps(burst_lo, burst_hi)
    result = {
        "burst": args.burst,
        "prompt_tokens": args.prompt_tokens,
        "burst_errors": len(burst_errors),
        "burst_error_samples": burst_errors[:3],
        "burst_s": round(burst_hi - burst_lo, 2),
        "burst_ttft_p50_s": round(percentile(ttfts, 0.5), 3),
        "burst_ttft_p99_s": round(percentile(ttfts, 0.99), 3),
        "itl_baseline_n": len(base),
        "itl_baseline_p50_ms": round(1000 * percentile(base, 0.5), 1),
        "itl_baseline_p99_ms": round(1000 * percentile(base, 0.99), 1),
        "itl_burst_n": len(during),
        "itl_burst_p50_ms": round(1000 * percentile(during, 0.5), 1),
        "itl_burst_p99_ms": round(1000 * percentile(during, 0.99), 1),
        "itl_p99_ratio": round(percentile(during, 0.99) / percentile(base, 0.99), 2),
        "itl_burst_worst": log.worst(burst_lo, burst_hi),
        "steady_errors": len(log.errors),
        "worker_failures": int(failures),
        "max_iteration_tokens": config.max_iteration_tokens,
        "step_timeout_s": config.step_timeout_s,
        "target": target,
    }
    return result


def bench_worker(args: argparse.Namespace, target: str) -> dict[str, Any]:
    """``--worker-only``: the scheduling of one in-process GpuWorker (see the module docstring)."""
    from specmask.gpu_worker.actor import GpuWorker
    from specmask.gpu_worker.config import WorkerConfig
    from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams

    fields: dict[str, Any] = dict(target_dir=target, device="cpu", torch_threads=args.torch_threads)
    if args.max_iteration_tokens is not None:
        fields["max_iteration_tokens"] = args.max_iteration_tokens
    worker = GpuWorker(WorkerConfig(**fields))
    plain = SpeculationParams(enabled=False, k=0)
    steady_prompt = tuple(burst_prompts(target, 1, 16)[0])

    def steady(i: int) -> NewSequence:
        sampling = SamplingParams(max_tokens=10**6, temperature=0.0)
        return NewSequence(f"steady{i}", steady_prompt, None, sampling, plain, stop_token_ids=())

    worker.add([steady(0)], wait_for_sessions=True)
    for _ in range(5):  # warm-up
        worker.step()
    base: list[float] = []
    deadline = time.monotonic() + args.baseline_s
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        worker.step()
        base.append(time.perf_counter() - t0)
    prompts = burst_prompts(target, args.burst, args.prompt_tokens)
    burst = [
        NewSequence(f"b{i}", tuple(p), None, SamplingParams(max_tokens=args.burst_max_tokens, temperature=0.0), plain)
        for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    errors = [e for e in worker.add(burst) if e is not None]
    ttft: dict[str, float] = {}
    during: list[float] = []
    finished: set[str] = set()
    while len(finished) + len(errors) < len(burst):
        t0 = time.perf_counter()
        outputs = worker.step()
        during.append(time.perf_counter() - t0)
        for out in outputs:
            if out.error:
                errors.append(out.error)
            if out.seq_id.startswith("b"):
                if out.new_token_ids and out.seq_id not in ttft:
                    ttft[out.seq_id] = time.perf_counter() - start
                if out.finish_reason is not None:
                    finished.add(out.seq_id)
    burst_s = time.perf_counter() - start
    worker.shutdown()
    ttfts = list(ttft.values())
    return {
        "mode": "worker-only",
        "burst": args.burst,
        "prompt_tokens": args.prompt_tokens,
        "burst_errors": len(errors),
        "burst_error_samples": errors[:3],
        "burst_s": round(burst_s, 2),
        "burst_ttft_p50_s": round(percentile(ttfts, 0.5), 3),
        "burst_ttft_p99_s": round(percentile(ttfts, 0.99), 3),
        "itl_baseline_n": len(base),
        "itl_baseline_p50_ms": round(1000 * percentile(base, 0.5), 1),
        "itl_baseline_p99_ms": round(1000 * percentile(base, 0.99), 1),
        "itl_burst_n": len(during),
        "itl_burst_p50_ms": round(1000 * percentile(during, 0.5), 1),
        "itl_burst_p99_ms": round(1000 * percentile(during, 0.99), 1),
        "itl_p99_ratio": round(percentile(during, 0.99) / percentile(base, 0.99), 2),
        "steady_errors": 0,
        "worker_failures": 0,
        "max_iteration_tokens": worker.config.max_iteration_tokens,
        "step_timeout_s": None,
        "target": target,
    }


def print_table(r: dict[str, Any]) -> None:
    print(f"{'phase':<10} {'ITL n':>7} {'ITL p50 ms':>11} {'ITL p99 ms':>11}")
    print(f"{'baseline':<10} {r['itl_baseline_n']:>7} {r['itl_baseline_p50_ms']:>11} {r['itl_baseline_p99_ms']:>11}")
    print(f"{'burst':<10} {r['itl_burst_n']:>7} {r['itl_burst_p50_ms']:>11} {r['itl_burst_p99_ms']:>11}")
    print(
        f"burst: {r['burst']} x {r['prompt_tokens']} prompt tokens in {r['burst_s']} s, "
        f"{r['burst_errors']} errors, TTFT p50 {r['burst_ttft_p50_s']} s p99 {r['burst_ttft_p99_s']} s; "
        f"ITL p99 ratio {r['itl_p99_ratio']}x; worker failures {r['worker_failures']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="target model dir or registered name (default: tiny pair)")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--burst", type=int, default=32, help="requests in the burst")
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="prompt tokens of each burst request")
    parser.add_argument("--burst-max-tokens", type=int, default=16)
    parser.add_argument("--stream-max-tokens", type=int, default=64, help="tokens per steady stream")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--baseline-s", type=float, default=20.0)
    parser.add_argument("--max-iteration-tokens", type=int, default=None, help="default: the server's")
    parser.add_argument(
        "--max-batch", type=int, default=None, help="sequences per worker (default: the server's; <= the budget)"
    )
    parser.add_argument("--step-timeout-s", type=float, default=30.0, help="the liveness limit")
    parser.add_argument("--worker-only", action="store_true", help="an in-process GpuWorker, no serving stack")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch threads of the worker (0 = every CPU)")
    args = parser.parse_args(argv)
    if args.worker_only:
        if args.target is None:
            parser.error("--worker-only needs --target")
        from specmask.gpu_worker.models.resolve import resolve_cli_models

        target, _ = resolve_cli_models(args.target, "none", toy=False, progress=False)
        result = bench_worker(args, target)
    elif args.target is None:
        from tests.fixtures.tiny_models import build_tiny_model_pair

        with tempfile.TemporaryDirectory(prefix="bench-burst-") as tmp:
            t, d = build_tiny_model_pair(tmp, max_position_embeddings=8192)
            result = asyncio.run(bench(args, str(t), str(d)))
    else:
        from specmask.gpu_worker.models.resolve import resolve_cli_models

        target, draft = resolve_cli_models(args.target, args.draft, toy=False, progress=False)
        result = asyncio.run(bench(args, target, draft))
    print_table(result)
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
