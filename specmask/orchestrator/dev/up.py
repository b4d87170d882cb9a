"""`specmask up`: the whole local stack in one command; Ctrl-C stops all of it.

Starts mask-service replica(s) as subprocesses, a local Ray with the GPU
worker actor(s), and the orchestrator on this process's event loop. Without
--target it serves SmolLM2-135M-Instruct (fetched and converted on first use,
then cached; gpu_worker/models); --toy serves the toy pair instead.

SIGINT / SIGTERM: the orchestrator stops gracefully (health NOT_SERVING,
in-flight RPCs get a grace period, sequences are freed), then the workers,
Ray and the mask services. Children also get SIGTERM if this process dies
abruptly (PR_SET_PDEATHSIG), so nothing is orphaned.

Locked by default: every port is checked before anything starts, the mask
services get a token generated for this start (the workers and the
orchestrator send it), Ray listens on 127.0.0.1 only, and ``--api-key`` /
``--api-key-file`` / ``SPECMASK_API_KEY(S)`` lock the public APIs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import secrets

from specmask.common.startup import StartupError, check_ports_free, port_flag
from specmask.mask_service.auth import OWNER_SECRET_ENV, TOKEN_ENV
from specmask.orchestrator import config as cfg
from specmask.orchestrator.auth_keys import ApiKeyError, api_keys_from_args
from specmask.orchestrator.dev.local_stack import LOOPBACK, StackConfig, running_stack
from specmask.orchestrator.main import LOG_FORMAT, add_fairness_and_auth_arguments, install_stop_signals


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
    parser.add_argument("--port", type=int, default=50051, help="orchestrator API port")
    parser.add_argument("--metrics-port", type=int, default=9464, help="Prometheus port (-1 = off)")
    parser.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API port (-1 = off)")
    parser.add_argument("--mask-replicas", type=int, default=1, help="mask-service processes")
    parser.add_argument("--num-workers", type=int, default=1, help="GPU worker actors")
    parser.add_argument("--max-queue", type=int, default=cfg.DEFAULT_MAX_QUEUE)
    add_fairness_and_auth_arguments(parser)
    parser.add_argument("--log-dir", default=".specmask/logs", help="where mask-service logs go")
    parser.add_argument("--log-level", default="INFO")


async def _up(stack: StackConfig, **overrides: object) -> None:
    """Serve until SIGINT/SIGTERM; ``overrides``: OrchestratorConfig fields and the stack's HTTP port."""
    async with running_stack(stack, **overrides) as running:
        # The orchestrator serves from this process: keep what startup loaded (torch, Ray,
        # the tokenizer: ~230k objects, a ~110 ms full GC pass) out of full GC passes on
        # the serving path, as `specmask orchestrator` does (specmask/orchestrator/main.py).
        gc.collect()
        gc.freeze()
        stop = asyncio.Event()
        install_stop_signals(stop)  # after ray.init, which installs its own SIGTERM handler
        metrics = running.server.metrics_port
        host = running.config.host
        print(
            f"specmask is up: API {running.address}"
            + (f", OpenAI API http://{host}:{running.server.http_port}/v1" if running.server.http_port else "")
            + (f", metrics http://{host}:{metrics}/metrics" if metrics else "")
            + f", mask service {', '.join(p.address for p in running.mask_services)}"
            + f", {stack.num_workers} worker(s). Ctrl-C to stop.",
            flush=True,
        )
        print(
            f"try: specmask generate --address {running.address} --any-json "
            '--prompt "Generate JSON for schema user:\\n"',
            flush=True,
        )
        await stop.wait()
        print("stopping...", flush=True)
    print("stopped", flush=True)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    http_port = None if args.http_port < 0 else args.http_port
    metrics_port = None if args.metrics_port < 0 else args.metrics_port
    # Before anything slow starts (Ray, the model): a taken port is one line and exit status 2.
    check_ports_free(
        LOOPBACK, [("--port", port_flag(args.port)), ("--metrics-port", metrics_port), ("--http-port", http_port)]
    )
    try:
        api_keys = api_keys_from_args(args)
    except ApiKeyError as exc:
        raise StartupError(str(exc)) from None
    from specmask.gpu_worker.models.errors import ModelError
    from specmask.gpu_worker.models.resolve import resolve_cli_models

    try:
        target, draft = resolve_cli_models(args.target, args.draft, toy=args.toy)
    except ModelError as exc:
        logging.getLogger(__name__).error("bad model: %s", exc)
        return 2
    # A fresh mask-service token for this stack: every tier (the mask services, the Ray
    # workers, the orchestrator) reads it from the environment it inherits from here, and
    # no other local process can call the mask service (mask_service.auth).
    os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)
    os.environ[OWNER_SECRET_ENV] = secrets.token_urlsafe(32)
    stack = StackConfig(
        target_dir=target,
        draft_dir=draft,
        mask_replicas=args.mask_replicas,
        port=args.port,
        metrics_port=metrics_port,
        num_workers=args.num_workers,
        log_dir=args.log_dir,
        restart_replicas=True,  # a crashed mask replica comes back, as under a Deployment
    )
    try:
        asyncio.run(
            _up(
                stack,
                max_queue=args.max_queue,
                http_port=http_port,
                max_inflight_per_client=args.max_inflight_per_client,
                api_keys=api_keys,
                cors_origins=tuple(args.cors_origin),
            )
        )
    except KeyboardInterrupt:  # Ctrl-C while starting: running_stack has cleaned up
        return 130
    return 0
