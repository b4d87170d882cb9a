"""What one mask-service round trip costs in CPU before any mask is computed.

    python -m bench.grpc_floor                       # SmolLM2-135M-Instruct's tokenizer if cached
    python -m bench.grpc_floor --tokenizer DIR --calls 3000

Starts a real mask service process (the same flags the local stack uses) and
sends it ``SessionCount`` calls, a unary RPC whose handler does nothing but read
a counter, one at a time from this process. Reports the CPU each side spends
per call (server: the service process from /proc; client: this process) and the
wall time per call. On a host where the service shares cores with a worker's
torch threads, every DraftMasks round trip pays at least this much on top of
its handler, which is why the drafter saves round trips (gpu_worker/drafting.py,
docs/performance.md). Prints a table and a final ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench.soak import cpu_seconds


def _default_tokenizer() -> str:
    """The cached default model's directory (never fetched: `specmask models get` does that)."""
    from specmask.gpu_worker.models.cache import cached_model
    from specmask.gpu_worker.models.registry import DEFAULT_MODEL

    path = cached_model(DEFAULT_MODEL)
    if path is None:
        raise SystemExit(f"{DEFAULT_MODEL} is not cached (`specmask models get {DEFAULT_MODEL}`): pass --tokenizer DIR")
    return str(path)


def measure(address: str, server_pid: int, calls: int) -> dict[str, float]:
    """One round of ``calls`` SessionCount calls: CPU and wall milliseconds per call."""
    import grpc

    from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb
    from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.MaskServiceStub(channel)
        request = pb.SessionCountRequest()
        for _ in range(min(calls, 100)):  # connection set-up and first-call paths, untimed
            stub.SessionCount(request, timeout=30)
        server0, client0, wall0 = cpu_seconds(server_pid), time.process_time(), time.perf_counter()
        for _ in range(calls):
            stub.SessionCount(request, timeout=30)
        wall = time.perf_counter() - wall0
        client = time.process_time() - client0
        server = cpu_seconds(server_pid) - server0
    return {
        "server_cpu_ms_per_call": 1000 * server / calls,
        "client_cpu_ms_per_call": 1000 * client / calls,
        "wall_ms_per_call": 1000 * wall / calls,
    }


def main(argv: list[str] | None = None) -> int:
    import grpc

    from specmask.orchestrator.dev.local_stack import MaskServiceProcess

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory the service loads")
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")

    service = MaskServiceProcess([args.tokenizer or _default_tokenizer()])
    service.start(wait=False)
    try:
        service.wait_serving(timeout_s=600.0)
        assert service.process is not None
        rounds = [measure(service.address, service.process.pid, args.calls) for _ in range(args.rounds)]
    finally:
        service.stop()

    keys = ("server_cpu_ms_per_call", "client_cpu_ms_per_call", "wall_ms_per_call")
    print(f"{'round':>5}  {'server CPU ms/call':>18}  {'client CPU ms/call':>18}  {'wall ms/call':>12}")
    for i, r in enumerate(rounds, 1):
        print(f"{i:>5}  {r[keys[0]]:>18.3f}  {r[keys[1]]:>18.3f}  {r[keys[2]]:>12.3f}")
    result: dict[str, object] = {k: round(statistics.median(r[k] for r in rounds), 4) for k in keys}
    result.update(
        calls_per_round=args.calls,
        rounds=args.rounds,
        grpcio=grpc.__version__,
        cpus=os.cpu_count(),
        load_average=list(os.getloadavg()),
    )
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
