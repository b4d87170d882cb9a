"""Soak the local stack with hostile traffic and measure whether steady traffic survives it.

    python -m bench.soak --baseline-s 30 --flood-s 60

A local stack (mask-service replicas as processes, local Ray, the
orchestrator; the toy model pair; 127.0.0.1 only) serves three clients:

* **steady**: constrained requests with a few known schemas, back to back,
  measured alone first (baseline) and then under the flood;
* **flood**: pathological schemas (10,000 optional properties, 300-deep
  nesting, a 20,000-value enum, schemas just inside the structural limits)
  and a stream of distinct schemas, so every one is a compile;
* **cancel**: streams cancelled at a random point.

Each role runs in a process of its own (not in this one, which hosts the
orchestrator) and is one API client to it (``specmask-client`` metadata), so
the compile queue's and ``--max-inflight-per-client``'s fairness apply per
role; the flood honours RESOURCE_EXHAUSTED retry hints (capped at 1 s).
``--flood-mode known`` floods with the steady schemas: the flood's generation
load alone, to tell it from what its schemas cost. Per phase the RESULT line
has ``phase_baseline`` / ``phase_flood``: CPU cores per process (and the whole
box's), the worker's mean step time and step-loop period (the step plus the gap before
the next), batch size and mask wait, the orchestrator's
event-loop lag (p50/p99 of how late a 2 ms timer fires), and where the phase's requests'
time to first token went: mean admission (validation, grammar check), queue (waiting
for a batch slot and the worker's next iteration) and time to first token (the rest is the first step).

Sampled every ``--sample-s``: RSS per process (orchestrator, each mask
replica and its compile workers, each GPU worker), open mask sessions and the
compile-queue depth (each replica's /metrics). Bounded by time and count. The
last line is ``RESULT {json}`` with steady_requests, steady_errors,
steady_p50/p99 (baseline and under flood), flood_requests, flood_rejected,
max_rss_mb per process, leaked_sessions (mask sessions still open once every
client has finished) and whether every replica answered health throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import random
import resource
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import grpc

from specmask.mask_service.auth import CLIENT_METADATA_KEY
from specmask.mask_service.server.memory import rss_bytes
from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.orchestrator.dev.local_stack import RunningStack, StackConfig, health_status, running_stack
from specmask.proto.rpc_status import details_of

logger = logging.getLogger(__name__)

PROMPT = "Generate JSON for schema user:\n"
STEADY_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}},
        "required": ["ok", "level"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    {"enum": ["red", "green", "blue"]},
]


def pathological_schemas() -> list[dict[str, Any]]:
    """The shapes once measured stalling the stack, plus ones just inside the default limits."""
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    arrays: dict[str, Any] = {"type": "integer"}
    for _ in range(500):
        arrays = {"type": "array", "items": arrays}
    return [
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}},
        deep,
        arrays,
        {"enum": [f"v{i}" for i in range(20_000)]},
        {"type": "object", "properties": {f"q{i}": {"type": "integer"} for i in range(1_900)}},
        {"enum": [f"w{i}" for i in range(4_000)]},
    ]


def distinct_schema(i: int) -> dict[str, Any]:
    """A new grammar every call (distinct property names): always a cache miss, always a compile."""
    return {
        "type": "object",
        "properties": {f"k{i}_{j}": {"type": "integer"} for j in range(40)},
        "required": [f"k{i}_0"],
    }


@dataclass
class Tally:
    latencies_ms: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    # Seconds of the phase the role was sending: the flood stops early once its share of
    # --max-flood-requests is used up (the rest of that phase then measures no flood).
    active_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ok(self, ms: float) -> None:
        with self.lock:
            self.requests += 1
            self.latencies_ms.append(ms)

    def error(self, code: str) -> None:
        with self.lock:
            self.requests += 1
            self.errors[code] = self.errors.get(code, 0) + 1

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    def merge(self, other: Tally) -> None:
        self.requests += other.requests
        self.active_s += other.active_s
        self.latencies_ms.extend(other.latencies_ms)
        for code, n in other.errors.items():
            self.errors[code] = self.errors.get(code, 0) + n


class GcWatch:
    """Full (generation 2) GC passes in this process, which hosts the orchestrator's event loop."""

    def __init__(self) -> None:
        self.passes, self.seconds, self.longest_s, self._t0 = 0, 0.0, 0.0, 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        self.passes, self.seconds, self.longest_s = self.passes + 1, self.seconds + took, max(self.longest_s, took)

    def summary(self) -> dict[str, float]:
        return {
            "passes": self.passes,
            "ms": round(1000 * self.seconds, 1),
            "longest_ms": round(1000 * self.longest_s, 1),
        }


def mean_phase(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-round phase figures averaged (steps summed; load averages as measured at each round's start)."""
    if len(phases) == 1:
        return phases[0]
    out: dict[str, Any] = {}
    for key, value in phases[0].items():
        values = [p[key] for p in phases]
        if key == "steps":
            out[key] = sum(values)
        elif key == "loadavg_at_start":
            out[key] = values
        elif isinstance(value, dict):
            out[key] = {k: round(sum(v.get(k, 0.0) for v in values) / len(values), 2) for k in value}
        else:
            out[key] = round(sum(values) / len(values), 2)
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _identity(role: str) -> tuple[tuple[str, str], ...]:
    """Each role is one API client to the orchestrator (its compile share, its in-flight cap)."""
    return ((CLIENT_METADATA_KEY, f"soak-{role}"),)


def steady_loop(address: str, stop: threading.Event, tally: Tally, max_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    with OrchestratorClient(address) as client:
        while not stop.is_set():
            req = build_request(PROMPT, schema=rng.choice(STEADY_SCHEMAS), temperature=0.0, max_tokens=max_tokens)
            t0 = time.perf_counter()
            try:
                client.stub.Generate(req, timeout=60, metadata=_identity("steady"))
                tally.ok((time.perf_counter() - t0) * 1000)
            except grpc.RpcError as exc:
                tally.error(exc.code().name)


def warm_up(address: str, max_tokens: int) -> None:
    """Not measured: each steady grammar compiled once, the first CPU steps taken."""
    with OrchestratorClient(address) as client:
        for schema in STEADY_SCHEMAS:
            client.generate(build_request(PROMPT, schema=schema, temperature=0.0, max_tokens=max_tokens), timeout_s=120)


# What the flood clients send (--flood-mode); "known" isolates the generation load
# the flood adds (no compiles, no refusals) from what its schemas cost.
FLOOD_MODES = ("mixed", "pathological", "distinct", "known")


def flood_schema(mode: str, i: int, bad: list[dict[str, Any]]) -> dict[str, Any]:
    if mode == "pathological" or (mode == "mixed" and i % 3 == 0):
        return bad[i % len(bad)]
    if mode == "known":
        return STEADY_SCHEMAS[i % len(STEADY_SCHEMAS)]
    return distinct_schema(i)


def flood_loop(address: str, stop: threading.Event, tally: Tally, max_requests: int, worker: int, mode: str) -> None:
    bad = pathological_schemas()
    # The fixed schemas' request messages built once: serialising the 300 KB one took the flood
    # client ~10 ms of CPU per request, on the 2 cores the server under test also runs on
    # (a real hostile client spends its own machine's CPU). The bytes sent are the same.
    built = {
        id(schema): build_request(PROMPT, schema=schema, temperature=0.0, max_tokens=4)
        for schema in (*bad, *STEADY_SCHEMAS)
    }
    i = worker * 1_000_000
    with OrchestratorClient(address) as client:
        while not stop.is_set() and tally.requests < max_requests:
            i += 1
            schema = flood_schema(mode, i, bad)
            try:
                req = built.get(id(schema))
                if req is None:  # a distinct schema: new every time
                    req = build_request(PROMPT, schema=schema, temperature=0.0, max_tokens=4)
                client.stub.Generate(req, timeout=60, metadata=_identity("flood"))
                tally.ok(0.0)
            except grpc.RpcError as exc:
                tally.error(exc.code().name)
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # The flood honours the server's retry hint (capped at 1 s): it stays a flood,
                    # but not a spin on instant refusals.
                    stop.wait(min(1.0, details_of(exc).retry_after_s or 0.1))


def cancel_loop(address: str, stop: threading.Event, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    with OrchestratorClient(address) as client:
        while not stop.is_set():
            req = build_request(PROMPT, schema=rng.choice(STEADY_SCHEMAS), temperature=1.0, max_tokens=64)
            call = client.stub.GenerateStream(req, timeout=60, metadata=_identity("cancel"))
            cancel_at = time.monotonic() + rng.uniform(0.05, 1.0)
            try:
                for _ in call:
                    if time.monotonic() >= cancel_at:
                        break
                call.cancel()
                tally.ok(0.0)
            except grpc.RpcError as exc:
                code = exc.code().name
                if code == "CANCELLED":
                    tally.ok(0.0)
                else:
                    tally.error(code)


def scrape(port: int | None, name: str) -> float | None:
    if port is None:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
    except OSError:
        return None
    return None


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (a replica's compile workers), from /proc/*/stat."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(pid):
            children.append(int(entry))
    return sorted(children)


class Sampler:
    """RSS per process, sessions and compile-queue depth, every ``interval_s``."""

    def __init__(
        self, running: RunningStack, worker_pids: list[int], interval_s: float, extra: dict[str, int] | None = None
    ) -> None:
        self._running = running
        self._worker_pids = worker_pids
        self._extra = dict(extra or {})  # e.g. Ray's GCS and raylet
        self._interval = interval_s
        self.samples: list[dict[str, Any]] = []
        self.max_rss_mb: dict[str, float] = {}
        self.unreachable = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def processes(self) -> dict[str, int]:
        procs = {"orchestrator": 0}
        for i, m in enumerate(self._running.mask_services):
            if m.process is not None:
                procs[f"mask-service-{i}"] = m.process.pid
                for j, c in enumerate(child_pids(m.process.pid)):
                    procs[f"mask-service-{i}-compile-{j}"] = c
        for i, pid in enumerate(self._worker_pids):
            procs[f"gpu-worker-{i}"] = pid
        procs.update(self._extra)
        return procs

    def sample(self) -> dict[str, Any]:
        rss = {name: rss_bytes(pid or "self") / 2**20 for name, pid in self.processes().items()}
        for name, mb in rss.items():
            self.max_rss_mb[name] = max(self.max_rss_mb.get(name, 0.0), round(mb, 1))
        sessions = queue = cache_mb = 0.0
        for m in self._running.mask_services:
            sessions += scrape(m.metrics_port, "specmask_mask_sessions") or 0.0
            queue += scrape(m.metrics_port, "specmask_mask_compile_queue_depth") or 0.0
            cache_mb += (scrape(m.metrics_port, "specmask_mask_grammar_cache_bytes") or 0.0) / 2**20
            if health_status(m.address, timeout_s=2.0) != 1:
                self.unreachable += 1
        row = {
            "t": round(time.monotonic(), 1),
            "rss_mb": rss,
            "sessions": sessions,
            "compile_queue": queue,
            "grammar_cache_mb": round(cache_mb, 1),
        }
        self.samples.append(row)
        return row

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            row = self.sample()
            logger.info(
                "sessions %d, compile queue %d, grammar cache %.0f MB, RSS MB %s",
                row["sessions"],
                row["compile_queue"],
                row["grammar_cache_mb"],
                {k: round(v) for k, v in row["rss_mb"].items()},
            )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _role_threads(role: str, address: str, stop: threading.Event, tally: Tally, opts: dict[str, Any]) -> list:
    if role == "steady":
        return [
            threading.Thread(target=steady_loop, args=(address, stop, tally, opts["max_tokens"], i))
            for i in range(opts["steady_concurrency"])
        ]
    if role == "flood":
        return [
            threading.Thread(
                target=flood_loop, args=(address, stop, tally, opts["max_flood_requests"], i, opts["flood_mode"])
            )
            for i in range(opts["flood_concurrency"])
        ]
    return [
        threading.Thread(target=cancel_loop, args=(address, stop, tally, 100 + i))
        for i in range(opts["cancel_concurrency"])
    ]


def run_role(role: str, address: str, seconds: float, opts: dict[str, Any]) -> Tally:
    """One client role (steady, flood or cancel) for ``seconds``, in this process's threads."""
    stop, tally = threading.Event(), Tally()
    threads = _role_threads(role, address, stop, tally, opts)
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:  # the flood's threads end early once its request count is used up
        t.join(max(0.0, start + seconds - time.monotonic()))
    tally.active_s = min(seconds, time.monotonic() - start)
    stop.set()
    for t in threads:
        t.join(120)
    return tally


def _role_process(role: str, address: str, seconds: float, opts: dict[str, Any], out: Any) -> None:
    """Child-process entry: run one role, send back its tally as plain data."""
    tally = run_role(role, address, seconds, opts)
    out.put((role, tally.requests, tally.latencies_ms, tally.errors, tally.active_s))


def _phase_roles(args: argparse.Namespace, hostile: bool) -> list[str]:
    roles = ["steady"]
    if hostile:
        roles += [r for r, n in (("flood", args.flood_concurrency), ("cancel", args.cancel_concurrency)) if n > 0]
    return roles


def run_phase(address: str, seconds: float, args: argparse.Namespace, *, hostile: bool) -> dict[str, Tally]:
    """The phase's clients; by default each role in a process of its own, so the clients'
    own work (building 300 KB schemas, protobuf) does not share the GIL of the
    orchestrator, which runs in this process (a real client never does)."""
    opts = {k: getattr(args, k) for k in (
        "max_tokens", "steady_concurrency", "flood_concurrency", "cancel_concurrency", "max_flood_requests",
        "flood_mode")}  # fmt: skip
    opts["max_flood_requests"] = max(1, args.max_flood_requests // args.rounds)  # the bound is for the whole run
    roles = _phase_roles(args, hostile)
    if args.in_process_clients:
        results: dict[str, Tally] = {}
        threads = [
            threading.Thread(target=lambda r=r: results.__setitem__(r, run_role(r, address, seconds, opts)))
            for r in roles
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # never fork a process with gRPC and Ray threads
    queue = ctx.Queue()
    procs = [ctx.Process(target=_role_process, args=(r, address, seconds, opts, queue), daemon=True) for r in roles]
    for proc in procs:
        proc.start()
    tallies: dict[str, Tally] = {}
    for _ in procs:
        role, requests, latencies, errors, active_s = queue.get(timeout=seconds + 300)
        tallies[role] = Tally(latencies_ms=latencies, errors=errors, requests=requests, active_s=active_s)
    for proc in procs:
        proc.join(30)
    return tallies


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of a process so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[-1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def box_busy_seconds() -> float:
    """CPU seconds the whole box spent busy (all processes, ours and others'), from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def ray_processes() -> dict[str, int]:
    """This driver's local Ray daemons (GCS, raylet): their RSS is part of the stack's."""
    try:
        import ray._private.worker as ray_worker

        node = ray_worker._global_node
        found = {}
        for kind in ("gcs_server", "raylet"):
            infos: list[Any] = node.all_processes.get(kind) or [] if node is not None else []
            if infos:
                found[f"ray-{kind}"] = infos[0].process.pid
        return found
    except Exception:  # a private API: the figures are optional
        return {}


class LoopLag:
    """How late the orchestrator's event loop runs a callback due now: a task sleeps
    ``period_s`` again and again and records by how much each wake-up overshot. The loop
    drives every worker's step loop and every stream, so its lag is a floor on their delays."""

    def __init__(self, period_s: float = 0.002) -> None:
        self._period = period_s
        self.lags_s: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="soak-loop-lag")

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self._period)
            self.lags_s.append(max(0.0, time.perf_counter() - t0 - self._period))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


# Orchestrator histograms PhaseMeter reports a per-phase mean of (specmask_<name>_seconds).
_PHASE_HISTOGRAMS = ("mask_wait", "request_admission", "request_queue", "time_to_first_token")


class PhaseMeter:
    """CPU per process (cores used on average), box-wide CPU, the worker's step figures and
    the orchestrator's event-loop lag over one phase."""

    def __init__(self, sampler: Sampler, metrics: Any, lag: LoopLag) -> None:
        self._sampler = sampler
        self._metrics = metrics
        self._lag = lag

    def _read(self) -> dict[str, Any]:
        reg = self._metrics.registry
        return {
            "t": time.monotonic(),
            "cpu": {name: cpu_seconds(pid or "self") for name, pid in self._sampler.processes().items()},
            "box": box_busy_seconds(),
            # The client processes of a phase, once joined (RUSAGE_CHILDREN counts waited-for children).
            "clients": sum(getattr(resource.getrusage(resource.RUSAGE_CHILDREN), f) for f in ("ru_utime", "ru_stime")),
            "steps": self._metrics.step_totals(),
            # Histograms read as (sum, count): a phase's mean is the delta of one over the other.
            **{
                name: (
                    reg.get_sample_value(f"specmask_{name}_seconds_sum") or 0.0,
                    reg.get_sample_value(f"specmask_{name}_seconds_count") or 0.0,
                )
                for name in _PHASE_HISTOGRAMS
            },
        }

    def start(self) -> None:
        self._start = self._read()
        self._loadavg = os.getloadavg()
        self._lag_from = len(self._lag.lags_s)

    def stop(self) -> dict[str, Any]:
        a, b = self._start, self._read()
        dt = max(1e-9, b["t"] - a["t"])
        (s0, sec0, seq0), (s1, sec1, seq1) = a["steps"], b["steps"]
        steps = max(1, s1 - s0)
        ours = {k: round((v - a["cpu"].get(k, 0.0)) / dt, 2) for k, v in b["cpu"].items()}
        ours["clients"] = round((b["clients"] - a["clients"]) / dt, 2)

        def mean_ms(name: str) -> float:
            return round(1000 * (b[name][0] - a[name][0]) / max(1.0, b[name][1] - a[name][1]), 1)

        lags = self._lag.lags_s[self._lag_from :]
        return {
            "cpu_cores": ours,
            "box_cpu_cores": round((b["box"] - a["box"]) / dt, 2),
            "loadavg_at_start": [round(x, 2) for x in self._loadavg],
            "steps": s1 - s0,
            "step_ms_mean": round(1000 * (sec1 - sec0) / steps, 1),
            # The step loop's period: a step plus the gap before the next (Ray's round trip, the
            # orchestrator applying outputs). One worker, so the phase's wall time over its steps.
            "cycle_ms_mean": round(1000 * dt / steps, 1),
            "batch_mean": round((seq1 - seq0) / steps, 2),
            "mask_wait_ms_mean": mean_ms("mask_wait"),
            # Every request finished or admitted in the phase (steady and flood alike): where its
            # time to first token went (admission, queue; the rest is its first step).
            "admission_ms_mean": mean_ms("request_admission"),
            "queue_ms_mean": mean_ms("request_queue"),
            "ttft_ms_mean": mean_ms("time_to_first_token"),
            "loop_lag_ms_p50": round(1000 * percentile(lags, 0.5), 2),
            "loop_lag_ms_p99": round(1000 * percentile(lags, 0.99), 2),
        }


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    if args.target is not None:
        return await _soak(args, args.target, args.draft)
    # The serving path is what is soaked, not the model: the tiny random-init pair
    # builds in a second (the trained toy pair takes an hour on a 2-core box), in a
    # directory removed with the run.
    from tests.fixtures.tiny_models import build_tiny_model_pair

    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        t, d = build_tiny_model_pair(tmp)
        return await _soak(args, str(t), str(d))


async def _soak(args: argparse.Namespace, target: str, draft: str | None) -> dict[str, Any]:
    import ray

    mask_args = ("--compile-timeout-s", str(args.compile_timeout_s), "--compile-queue", str(args.compile_queue))
    stack = StackConfig(
        target_dir=target,
        draft_dir=draft,
        mask_replicas=args.mask_replicas,
        num_workers=1,
        mask_args=mask_args,
        mask_metrics=True,
        worker_logs=False,
    )
    async with running_stack(stack, max_queue=256, max_inflight_per_client=args.max_inflight_per_client) as running:
        # This process hosts the orchestrator: as `specmask orchestrator` and `specmask up` do,
        # keep what startup loaded out of full GC passes (~110 ms each over torch, Ray and the
        # tokenizer's objects, on the event loop that drives every step).
        gc.collect()
        gc.freeze()
        gc_watch = GcWatch()
        pids = [ray.get(a.info.remote(), timeout=60).pid for a in running.server.worker_actors]
        sampler = Sampler(running, pids, args.sample_s, ray_processes())
        sampler.sample()
        sampler.start()
        await asyncio.to_thread(warm_up, running.address, args.max_tokens)
        lag = LoopLag()
        lag.start()
        meter = PhaseMeter(sampler, running.server.metrics, lag)
        # --rounds > 1 alternates shorter baseline and flood phases, so a change in the box's
        # other load during the run weighs on both sides of the ratio alike.
        baseline, under, flood, cancels = Tally(), Tally(), Tally(), Tally()
        phases_baseline: list[dict[str, Any]] = []
        phases_flood: list[dict[str, Any]] = []
        round_ratios = []
        flood_active = []  # per round: (seconds the flood sent, phase seconds)
        for r in range(args.rounds):
            if r:
                await asyncio.sleep(args.settle_s)  # the last round's cancelled streams free their sessions
            meter.start()
            base_r = (
                await asyncio.to_thread(run_phase, running.address, args.baseline_s / args.rounds, args, hostile=False)
            )["steady"]
            phases_baseline.append(meter.stop())
            logger.info("round %d baseline phase: %s", r, phases_baseline[-1])
            meter.start()
            tallies = await asyncio.to_thread(
                run_phase, running.address, args.flood_s / args.rounds, args, hostile=True
            )
            phases_flood.append(meter.stop())
            logger.info("round %d flood phase: %s", r, phases_flood[-1])
            for total, part in (
                (baseline, base_r),
                (under, tallies["steady"]),
                (flood, tallies.get("flood", Tally())),
                (cancels, tallies.get("cancel", Tally())),
            ):
                total.merge(part)
            flood_active.append(round(tallies.get("flood", Tally()).active_s, 1))
            round_ratios.append(
                round(percentile(tallies["steady"].latencies_ms, 0.99) / percentile(base_r.latencies_ms, 0.99), 2)
            )
        phase_baseline, phase_flood = mean_phase(phases_baseline), mean_phase(phases_flood)
        logger.info("flood: %d requests, errors %s; cancels: %d, errors %s", flood.requests, flood.errors,
                    cancels.requests, cancels.errors)  # fmt: skip
        flood.errors.update({f"cancel:{k}": v for k, v in cancels.errors.items()})
        await asyncio.sleep(args.settle_s)  # cancelled streams free their sessions on the next step
        sampler.stop()
        lag.stop()
        last = sampler.sample()
        steady_all = baseline.requests + under.requests
        steady_errors = baseline.num_errors + under.num_errors
        result = {
            "steady_requests": steady_all,
            "steady_errors": steady_errors,
            "steady_success_rate": round(1 - steady_errors / max(1, steady_all), 4),
            "steady_error_codes": {**baseline.errors, **under.errors},
            "steady_p50_ms_baseline": round(percentile(baseline.latencies_ms, 0.5), 1),
            "steady_p99_ms_baseline": round(percentile(baseline.latencies_ms, 0.99), 1),
            "steady_p50_ms_under_flood": round(percentile(under.latencies_ms, 0.5), 1),
            "steady_p99_ms_under_flood": round(percentile(under.latencies_ms, 0.99), 1),
            "flood_requests": flood.requests,
            "flood_rejected": flood.num_errors,
            "flood_error_codes": flood.errors,
            "max_rss_mb": sampler.max_rss_mb,
            "max_compile_queue": max((s["compile_queue"] for s in sampler.samples), default=0),
            "flood_mode": args.flood_mode,
            "max_inflight_per_client": args.max_inflight_per_client,
            "phase_baseline": phase_baseline,
            "phase_flood": phase_flood,
            "rss_mb_first_last": {
                k: [round(sampler.samples[0]["rss_mb"].get(k, 0.0)), round(v)] for k, v in last["rss_mb"].items()
            },
            "leaked_sessions": int(last["sessions"]),
            "health_unreachable_samples": sampler.unreachable,
            "samples": len(sampler.samples),
            "rounds": args.rounds,
            "steady_p99_ratio_per_round": round_ratios,
            # Seconds of each flood phase (--flood-s / --rounds) in which the flood was sending.
            "flood_active_s_per_round": flood_active,
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
            "orchestrator_gc_full": gc_watch.summary(),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF model dir (default: the tiny test pair, built now)")
    p.add_argument("--draft", default=None)
    p.add_argument("--baseline-s", type=float, default=30.0)
    p.add_argument("--flood-s", type=float, default=60.0)
    p.add_argument("--settle-s", type=float, default=3.0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate this many baseline/flood phase pairs (each 1/rounds of --baseline-s/--flood-s)",
    )
    p.add_argument("--steady-concurrency", type=int, default=2)
    p.add_argument("--flood-concurrency", type=int, default=6)
    p.add_argument("--cancel-concurrency", type=int, default=1)
    p.add_argument(
        "--flood-mode",
        choices=FLOOD_MODES,
        default="mixed",
        help="mixed: 1/3 pathological, 2/3 distinct valid schemas (compiled, then generated: they share the "
        "worker); pathological; distinct; known: the steady schemas (generation load only, no compiles)",
    )
    p.add_argument("--no-distinct", action="store_true", help="same as --flood-mode pathological")
    p.add_argument(
        "--in-process-clients",
        action="store_true",
        help="run the clients as threads of this process, which also hosts the orchestrator (GIL shared)",
    )
    p.add_argument(
        "--max-flood-requests",
        type=int,
        default=20000,
        help="requests of the flood role in all (its threads share it), over every round, split evenly; "
        "a bound, not a target: the default lets the flood send for whole phases (it sent 50-100 requests/s "
        "here; 6,000 ran out before the last round's end on a fast day); flood_active_s_per_round in RESULT "
        "says how long it did",
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--mask-replicas", type=int, default=1)
    p.add_argument(
        "--max-inflight-per-client",
        type=int,
        default=0,
        help="the orchestrator's per-client in-flight cap (each client role is one client); 0 = none",
    )
    p.add_argument("--compile-timeout-s", type=float, default=4.0)
    p.add_argument("--compile-queue", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    if args.no_distinct:
        args.flood_mode = "pathological"
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(__name__).setLevel(logging.INFO)
    result = asyncio.run(soak(args))
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
