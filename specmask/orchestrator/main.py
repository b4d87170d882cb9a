"""`specmask orchestrator`: flags -> config -> server; SIGTERM/SIGINT -> graceful stop."""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import signal
from collections.abc import Callable

from specmask.common import tracing
from specmask.common.config_flags import ConfigFlags
from specmask.common.log_format import configure_logging
from specmask.common.startup import StartupError, check_model_dir, check_ports_free
from specmask.orchestrator.auth_keys import add_api_key_arguments, api_keys_from_args
from specmask.orchestrator.config import OrchestratorConfig

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@functools.cache
def orchestrator_flags() -> ConfigFlags:
    """Every OrchestratorConfig field that declares a flag, as `specmask orchestrator` takes it."""
    return ConfigFlags(OrchestratorConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    orchestrator_flags().add_to(parser)
    # The keys are not one field's flag: they are read together with the environment's.
    add_api_key_arguments(parser)


def config_from_args(args: argparse.Namespace) -> OrchestratorConfig:
    """The one place flags become configuration."""
    return OrchestratorConfig(**orchestrator_flags().values(args), api_keys=api_keys_from_args(args))


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM / SIGINT set ``stop`` (a second signal is ignored: shutdown is already running).

    Call after Ray is initialised: ray.init installs its own SIGTERM handler,
    which would otherwise replace this one and exit without a graceful stop.
    """
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        logger.info("signal %s: graceful shutdown", sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


async def serve(config: OrchestratorConfig, *, on_ready: Callable[[int], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then stop gracefully."""
    from specmask.orchestrator.api.grpc_server import (
        create_server,  # heavy imports (Ray, torch types) once the role is chosen
    )

    server, port = await create_server(config)
    # The tokenizer and Ray's state are loaded: keep them out of full GC passes
    # on the serving path (see specmask/mask_service/server/main.py).
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    install_stop_signals(stop)
    await server.start()
    logger.info("orchestrator serving on %s:%d", config.host, port)
    if on_ready is not None:
        on_ready(port)
    try:
        await stop.wait()
    finally:
        await server.stop()
        logger.info("orchestrator stopped")


def shutdown_local_ray(config: OrchestratorConfig) -> None:
    if config.ray_address == "local":
        import ray

        ray.shutdown()


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    from specmask.gpu_worker.models.errors import ModelError
    from specmask.gpu_worker.models.resolve import NO_DRAFT, resolve_pair

    # Operator mistakes end here as one-line errors (specmask prints them), before Ray starts.
    try:
        # Registered names -> cached dirs, and a draft/target tokenizer mismatch refused.
        args.target, args.draft = resolve_pair(args.target, args.draft or NO_DRAFT)
    except ModelError as exc:
        raise StartupError(f"bad model: {exc}") from None
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise StartupError(f"bad configuration: {exc}") from None
    try:
        tracing.check_installed(config.otlp_traces_endpoint)
    except RuntimeError as exc:
        raise StartupError(str(exc)) from None
    check_model_dir(config.target_dir, "--target")
    if config.draft_dir is not None:
        check_model_dir(config.draft_dir, "--draft", tokenizer=False)
    check_ports_free(
        config.host,
        [("--port", config.port), ("--metrics-port", config.metrics_port), ("--http-port", config.http_port)],
    )
    try:
        from specmask.orchestrator.worker_pool import connect_ray

        # Here, on the main thread: create_server's call is then a no-op.
        connect_ray(config.ray_address, join_timeout_s=config.ray_join_timeout_s)
    except (ConnectionError, TimeoutError, ValueError) as exc:
        raise StartupError(f"cannot join the Ray cluster at {config.ray_address}: {exc}") from None
    try:
        asyncio.run(serve(config))
    finally:
        shutdown_local_ray(config)
    return 0
