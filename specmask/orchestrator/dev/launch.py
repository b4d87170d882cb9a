"""The one start-up path of the commands that run the whole local stack: `up` and `serve`.

Each command reads its own flags (`up`'s names, or vLLM's for `serve`) into a ``Launch``;
``launch`` starts it the one way, locked by default:

1. the public ports: in range, no two flags naming one, each free on the bind host, checked
   before anything slow (Ray, the model, a download), so a taken port is one line and exit 2;
2. the API keys (``--api-key``, ``--api-key-file``, ``SPECMASK_API_KEY(S)``), the model pair
   and the orchestrator's configuration, each refused the same way;
3. a mask-service token and a session-owner secret made for this start, in the environment
   every tier inherits (the mask services, the Ray workers, the orchestrator): no other local
   process can call the mask services (mask_service.auth);
4. the stack, until SIGINT/SIGTERM.

The mask services and Ray listen on 127.0.0.1 only, whatever ``--host`` says: it moves only
the public APIs.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from specmask.common.config_flags import ConfigFlags
from specmask.common.startup import StartupError, check_ports_free, port_flag
from specmask.mask_service.auth import OWNER_SECRET_ENV, TOKEN_ENV
from specmask.orchestrator.auth_keys import ApiKeyError, add_api_key_arguments, api_keys_from_args
from specmask.orchestrator.config import OrchestratorConfig
from specmask.orchestrator.dev.local_stack import LOOPBACK, StackConfig, running_stack
from specmask.orchestrator.main import LOG_FORMAT, install_stop_signals

# The token's and the owner secret's entropy, in bytes (secrets.token_urlsafe).
SECRET_BYTES = 32

# The OrchestratorConfig fields `up` and `serve` both take as flags, declared on the fields
# as `specmask orchestrator` takes them (vLLM's --max-num-seqs, --max-num-batched-tokens,
# --gpu-memory-utilization and --dtype among them: docs/scheduling.md, docs/models.md).
STACK_FIELDS = (
    "num_workers",
    "max_queue",
    "max_batch",
    "max_iteration_tokens",
    "gpu_memory_utilization",
    "kv_cache_bytes",
    "dtype",
    "max_inflight_per_client",
    "cors_origins",
    "grammar_fallback",
    "reasoning_parser",
    "tool_call_parser",
    "worker_log_level",
    "otlp_traces_endpoint",  # the stack's mask services get it too (launch)
)


@functools.cache
def stack_flags() -> ConfigFlags:
    return ConfigFlags(OrchestratorConfig, STACK_FIELDS)


@dataclass(frozen=True)
class PortFlag:
    """A public port as its command names it."""

    flag: str  # as the command line spells it: the error line names it
    value: int  # as given: -1 = off, 0 = a free port picked at bind time, else that port


@dataclass(frozen=True)
class Launch:
    """What one command asks of the stack, before anything is checked or started."""

    host: str  # where the public APIs bind
    grpc: PortFlag  # never off: the gRPC server is the engine's front door
    http: PortFlag
    metrics: PortFlag
    # (target dir, draft dir or None), resolved after the port check: it may fetch a model.
    # ModelError for a model that cannot be had.
    models: Callable[[], tuple[str, str | None]]
    # OrchestratorConfig fields the command sets beyond the shared flags (served_model_name, ...).
    orchestrator: Mapping[str, object] = field(default_factory=dict)


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `up` and `serve` share, with the same names and defaults."""
    parser.add_argument("--mask-replicas", type=int, default=1, help="mask-service processes")
    stack_flags().add_to(parser)
    add_api_key_arguments(parser)
    parser.add_argument("--log-dir", default=".specmask/logs", help="where mask-service logs go")


def issue_stack_secrets() -> None:
    """A fresh mask-service token and session-owner secret for the stack this process starts.

    Set in this process's environment before anything starts: the mask-service subprocesses,
    the Ray workers and the orchestrator all read them from the environment they inherit.
    """
    os.environ[TOKEN_ENV] = secrets.token_urlsafe(SECRET_BYTES)
    os.environ[OWNER_SECRET_ENV] = secrets.token_urlsafe(SECRET_BYTES)


async def serve_until_stopped(stack: StackConfig, **overrides: object) -> None:
    """Serve until SIGINT/SIGTERM; ``overrides``: OrchestratorConfig fields."""
    async with running_stack(stack, **overrides) as running:
        # The orchestrator serves from this process: keep what startup loaded (torch, Ray,
        # the tokenizer: hundreds of thousands of objects) out of full GC passes on
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


def config_overrides(args: argparse.Namespace, plan: Launch, *, http_port: int | None) -> dict[str, object]:
    """The OrchestratorConfig fields a start sets: the shared flags', then the command's own.

    StartupError when the API keys cannot be read (a missing or empty key file).
    """
    try:
        api_keys = api_keys_from_args(args)
    except ApiKeyError as exc:
        raise StartupError(str(exc)) from None
    return {
        "host": plan.host,
        "http_port": http_port,
        "api_keys": api_keys,
        **stack_flags().values(args),
        **plan.orchestrator,
    }


def launch(args: argparse.Namespace, plan: Launch) -> int:
    """Check, then start and serve ``plan`` until stopped; StartupError for an operator mistake.

    ``args`` holds the shared flags (``add_stack_arguments``).
    """
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    grpc_port = port_flag(plan.grpc.value)
    if grpc_port is None:
        raise StartupError(f"{plan.grpc.flag} -1: the gRPC API cannot be off (0 = a free port)")
    http_port = port_flag(plan.http.value)
    metrics_port = port_flag(plan.metrics.value)
    for flag, value in (("--mask-replicas", args.mask_replicas), ("--num-workers", args.num_workers)):
        if value < 1:
            raise StartupError(f"{flag} must be at least 1, got {value}")
    check_ports_free(
        plan.host, [(plan.grpc.flag, grpc_port), (plan.http.flag, http_port), (plan.metrics.flag, metrics_port)]
    )
    overrides = config_overrides(args, plan, http_port=http_port)
    from specmask.gpu_worker.models.errors import ModelError

    try:
        target, draft = plan.models()
    except ModelError as exc:
        raise StartupError(f"bad model: {exc}") from None
    stack = StackConfig(
        target_dir=target,
        draft_dir=draft,
        mask_replicas=args.mask_replicas,
        port=grpc_port,
        metrics_port=metrics_port,
        num_workers=args.num_workers,
        log_dir=args.log_dir,
        restart_replicas=True,  # a crashed mask replica comes back, as under a Deployment
        # Every tier traces to the same collector (docs/operations.md#tracing).
        mask_args=("--otlp-traces-endpoint", args.otlp_traces_endpoint) if args.otlp_traces_endpoint else (),
    )
    try:
        # The mask addresses exist once the services serve; any well-formed one lets the
        # rest of the configuration be checked now, before anything starts.
        stack.orchestrator_config([f"{LOOPBACK}:1"], **overrides)
    except ValueError as exc:
        raise StartupError(f"bad configuration: {exc}") from None
    issue_stack_secrets()
    try:
        asyncio.run(serve_until_stopped(stack, **overrides))
    except KeyboardInterrupt:  # Ctrl-C while starting: running_stack has cleaned up
        return 130
    return 0
