#!/usr/bin/env python3
"""Exit 0 if a gRPC server's health service (grpc.health.v1) answers SERVING, else 1.

Used as the container HEALTHCHECK of the mask-service and orchestrator images.
Kubernetes does not need it (the chart uses native `grpc:` probes); plain
Docker / Compose does. Depends only on grpcio + grpcio-health-checking, not on
specmask, so it keeps working whatever the service's own imports do.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as err:
            print(f"{address}: {err.code().name}", file=sys.stderr)
            return False
    serving = response.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}", file=sys.stderr)
    return serving


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051", help="host:port of the gRPC server")
    parser.add_argument("--service", default="", help="service name to check; '' = the whole server")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    return 0 if check(args.address, args.service, args.timeout_s) else 1


if __name__ == "__main__":
    sys.exit(main())
