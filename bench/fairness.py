"""One client's flood against another client's latency: the orchestrator's fairness, measured.

    python -m bench.fairness --requests 30 --flood-concurrency 24

A local stack (one mask replica, local Ray, one worker, the orchestrator on this
process's loop; the tiny random-init model pair unless --target; 127.0.0.1 only)
with two API keys, so each client is one identity (orchestrator.client_identity):

* **alone**: the light client sends ``--requests`` short requests, one after
  another, on an idle stack;
* **fair**: the same, while the flood client keeps ``--flood-concurrency`` long
  requests in flight (a new one as each ends; RESOURCE_EXHAUSTED answers are
  retried after a short pause), under the defaults: fair placement and the
  per-client in-flight cap;
* **fifo** (the control, same run): the same flood with placement in arrival
  order and no per-client cap, i.e. what the orchestrator did before.

The light client's p50/p99 latency per phase, the ratios ``fair_p99 / alone_p99``
(the goal: at most 3) and ``fifo_p99 / alone_p99``, and the flood's completed,
refused and timed-out requests. The last line is ``RESULT {json}``.

``--saturate N`` keeps N busy processes spinning through every phase (alone
included; not during the stack's start), as other work on the machine would; ``--case smollm2-saturated`` is
the real-model case: SmolLM2-135M-Instruct (the registered default model, its
default draft), every core saturated, a 40-request flood, 8-token light requests:

    python -m bench.fairness --case smollm2-saturated
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import multiprocessing
import os
import tempfile
import threading
import time
from typing import Any

import grpc

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.orchestrator.dev.local_stack import RunningStack, StackConfig, running_stack

logger = logging.getLogger(__name__)
LIGHT_KEY = "bench-fairness-light"
FLOOD_KEY = "bench-fairness-flood"
PROMPT = "Generate JSON for schema user:\n"
_RETRY_PAUSE_S = 0.05


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _metadata(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def light_phase(address: str, n: int, max_tokens: int) -> list[float]:
    """``n`` short requests back to back; their latencies (seconds)."""
    latencies = []
    with OrchestratorClient(address) as client:
        for i in range(n):
            req = build_request(PROMPT, max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=i)
            t0 = time.perf_counter()
            resp = client.stub.Generate(req, timeout=600, metadata=_metadata(LIGHT_KEY))
            latencies.append(time.perf_counter() - t0)
            if resp.error:
                raise RuntimeError(f"light request failed: {resp.error}")
    return latencies


def _flood_thread(
    address: str, index: int, max_tokens: int, stop: Any, completed: Any, refused: Any, timed_out: Any
) -> None:
    with OrchestratorClient(address) as client:
        seed = index * 100_000
        while not stop.is_set():
            seed += 1
            req = build_request(PROMPT, max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=seed)
            try:
                client.stub.Generate(req, timeout=600, metadata=_metadata(FLOOD_KEY))
                with completed.get_lock():
                    completed.value += 1
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Held back past the client's deadline (the flood's share, a slow machine):
                    # counted, and the thread sends its next request.
                    with timed_out.get_lock():
                        timed_out.value += 1
                    continue
                if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                with refused.get_lock():
                    refused.value += 1
                time.sleep(_RETRY_PAUSE_S)


def _flood_process(
    address: str, concurrency: int, max_tokens: int, stop: Any, completed: Any, refused: Any, timed_out: Any
) -> None:
    threads = [
        threading.Thread(
            target=_flood_thread, args=(address, i, max_tokens, stop, completed, refused, timed_out), daemon=True
        )
        for i in range(concurrency)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Flood:
    """``concurrency`` requests kept in flight (a new one as each ends) until stopped, from a
    process of its own: its client threads do not take this process's GIL from the
    orchestrator, which serves from here."""

    def __init__(self, address: str, concurrency: int, max_tokens: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._completed = ctx.Value("i", 0)
        self._refused = ctx.Value("i", 0)
        self._timed_out = ctx.Value("i", 0)
        self._proc = ctx.Process(
            target=_flood_process,
            args=(address, concurrency, max_tokens, self._stop, self._completed, self._refused, self._timed_out),
            daemon=True,
        )

    @property
    def completed(self) -> int:
        return int(self._completed.value)

    @property
    def refused(self) -> int:
        return int(self._refused.value)

    @property
    def timed_out(self) -> int:
        return int(self._timed_out.value)

    def __enter__(self) -> Flood:
        self._proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(timeout=600)
        if self._proc.exitcode != 0:
            raise RuntimeError(f"the flood process failed (exit status {self._proc.exitcode})")


def _spin() -> None:
    while True:
        pass


class Saturation:
    """``n`` processes spinning on a core each until stopped: other work keeping the cores busy."""

    def __init__(self, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._procs = [ctx.Process(target=_spin, daemon=True, name=f"bench-fairness-spin-{i}") for i in range(n)]

    def __enter__(self) -> Saturation:
        for proc in self._procs:
            proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            proc.join(timeout=10)


# Named cases: argument defaults they set (the command line still overrides each).
CASES: dict[str, dict[str, Any]] = {
    "smollm2-saturated": {
        "target": "smollm2-135m-instruct",
        "saturate": os.cpu_count() or 2,
        "requests": 5,
        "max_tokens": 8,
        "flood_concurrency": 40,
        "flood_max_tokens": 48,
        "no_control": True,
    },
}


def wait_saturated(running: RunningStack, min_live: int, timeout_s: float = 120.0) -> None:
    """Until the flood holds at least ``min_live`` requests in the engine."""
    deadline = time.monotonic() + timeout_s
    while running.server.engine.num_live() < min_live and time.monotonic() < deadline:
        time.sleep(0.05)


def set_fair(running: RunningStack, fair: bool, cap: int) -> None:
    engine = running.server.engine
    # Read per request and per placement: switched between phases of one run.
    engine._config = dataclasses.replace(engine._config, fair_placement=fair, max_inflight_per_client=cap)


def flood_phase(running: RunningStack, args: argparse.Namespace) -> tuple[list[float], Flood]:
    with Flood(running.address, args.flood_concurrency, args.flood_max_tokens) as flood:
        wait_saturated(running, min(args.flood_concurrency, args.max_batch))
        latencies = light_phase(running.address, args.requests, args.max_tokens)
    return latencies, flood


def summary(latencies: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(1000 * percentile(latencies, 0.5), 1),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 1),
        "n": len(latencies),
    }


async def _run(args: argparse.Namespace, target: str, draft: str | None) -> dict[str, Any]:
    stack = StackConfig(target_dir=target, draft_dir=draft, mask_replicas=1, num_workers=1, worker_logs=False)
    async with running_stack(
        stack, max_queue=args.max_queue, max_batch=args.max_batch, api_keys=(LIGHT_KEY, FLOOD_KEY)
    ) as running:
        default_cap = running.config.inflight_cap_per_client
        # Saturated from the warm-up on, not during start-up: Ray's start has a deadline.
        with Saturation(args.saturate):
            # Warm-up: the first requests pay for compiles and lazy initialisation.
            await asyncio.to_thread(light_phase, running.address, 2, args.max_tokens)
            alone = await asyncio.to_thread(light_phase, running.address, args.requests, args.max_tokens)
            set_fair(running, True, default_cap)
            fair, fair_flood = await asyncio.to_thread(flood_phase, running, args)
            control: dict[str, Any] = {}
            if not args.no_control:
                set_fair(running, False, 0)
                fifo, fifo_flood = await asyncio.to_thread(flood_phase, running, args)
                set_fair(running, True, default_cap)
                control = {
                    "fifo": summary(fifo),
                    "fifo_flood_completed": fifo_flood.completed,
                    "fifo_flood_refused": fifo_flood.refused,
                    "fifo_flood_timed_out": fifo_flood.timed_out,
                }
    base = summary(alone)
    result: dict[str, Any] = {
        "alone": base,
        "fair": summary(fair),
        "fair_flood_completed": fair_flood.completed,
        "fair_flood_refused": fair_flood.refused,
        "fair_flood_timed_out": fair_flood.timed_out,
        "per_client_cap": default_cap,
        "max_batch": args.max_batch,
        "flood_concurrency": args.flood_concurrency,
        "saturating_processes": args.saturate,
        "cpus": os.cpu_count(),
        "target": target,
        "draft": draft,
        **control,
    }
    result["fair_p99_ratio"] = round(result["fair"]["p99_ms"] / base["p99_ms"], 2)
    if control:
        result["fifo_p99_ratio"] = round(control["fifo"]["p99_ms"] / base["p99_ms"], 2)
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"{'phase':<8} {'n':>4} {'p50 ms':>10} {'p99 ms':>10} {'p99 / alone':>12}")
    for phase in ("alone", "fair", "fifo"):
        if phase not in result:
            continue
        row = result[phase]
        ratio = row["p99_ms"] / result["alone"]["p99_ms"]
        print(f"{phase:<8} {row['n']:>4} {row['p50_ms']:>10.1f} {row['p99_ms']:>10.1f} {ratio:>12.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=sorted(CASES), default=None, help="a named case (sets the defaults below)")
    p.add_argument(
        "--target", default=None, help="HF model dir or registered name (default: the tiny test pair, built now)"
    )
    p.add_argument("--draft", default=None, help="draft dir or registered name; none = no draft model")
    p.add_argument("--saturate", type=int, default=0, help="busy processes kept spinning through every phase")
    p.add_argument("--requests", type=int, default=30, help="light requests per phase")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per light request")
    p.add_argument("--flood-concurrency", type=int, default=24, help="flood requests kept in flight")
    p.add_argument("--flood-max-tokens", type=int, default=48, help="tokens per flood request")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--no-control", action="store_true", help="skip the arrival-order control phase")
    p.add_argument("--log-level", default="WARNING")
    pre, _ = p.parse_known_args(argv)
    if pre.case is not None:
        p.set_defaults(**CASES[pre.case])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.target is not None:
        from specmask.gpu_worker.models.resolve import resolve_pair

        target, draft = resolve_pair(args.target, args.draft)
        result = asyncio.run(_run(args, target, draft))
    else:
        from tests.fixtures.tiny_models import build_tiny_model_pair

        with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
            t, d = build_tiny_model_pair(tmp)
            result = asyncio.run(_run(args, str(t), str(d)))
    print_table(result)
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
