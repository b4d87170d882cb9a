"""`specmask up`: the whole local stack in one command; Ctrl-C stops all of it.

Starts mask-service replica(s) as subprocesses, a local Ray with the GPU
worker actor(s), and the orchestrator on this process's event loop. Without
--target it serves SmolLM2-135M-Instruct (fetched and converted on first use,
then cached; gpu_worker/models); --toy serves the toy pair instead.

SIGINT / SIGTERM: the orchestrator stops gracefully (health NOT_SERVING,
in-flight RPCs get a grace period, sequences are freed), then the workers,
Ray and the mask services. Children also get SIGTERM if this process dies
abruptly (PR_SET_PDEATHSIG), so nothing is orphaned.

Locked by default, as `specmask serve` (both start through dev.launch): every
port is checked before anything starts, the mask services get a token
generated for this start (the workers and the orchestrator send it), Ray
listens on 127.0.0.1 only, and ``--api-key`` / ``--api-key-file`` /
``SPECMASK_API_KEY(S)`` lock the public APIs.
"""

from __future__ import annotations

import argparse
import functools

from specmask.common.config_flags import ConfigFlags
from specmask.orchestrator.config import OrchestratorConfig
from specmask.orchestrator.dev.launch import Launch, PortFlag, add_stack_arguments, launch
from specmask.orchestrator.dev.local_stack import LOOPBACK

# A local stack shows its metrics by default, on the OpenTelemetry Prometheus exporter's port.
UP_METRICS_PORT = 9464


@functools.cache
def port_flags() -> ConfigFlags:
    """The public ports, as OrchestratorConfig declares them (Launch checks and reads them)."""
    return ConfigFlags(
        OrchestratorConfig, ("port", "metrics_port", "http_port"), defaults={"metrics_port": UP_METRICS_PORT}
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=None,
        metavar="DIR|NAME",
        help="target model dir or registered name (default: smollm2-135m-instruct, fetched on first use)",
    )
    parser.add_argument(
        "--draft", default=None, metavar="DIR|NAME", help="draft model dir or name; 'none' = no draft model"
    )
    parser.add_argument("--toy", action="store_true", help="the small toy target/draft pair (trained on first use)")
    port_flags().add_to(parser)
    add_stack_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from specmask.gpu_worker.models.resolve import resolve_cli_models

    return launch(
        args,
        Launch(
            host=LOOPBACK,
            grpc=PortFlag("--port", args.port),
            http=PortFlag("--http-port", args.http_port),
            metrics=PortFlag("--metrics-port", args.metrics_port),
            models=lambda: resolve_cli_models(args.target, args.draft, toy=args.toy),
        ),
    )
