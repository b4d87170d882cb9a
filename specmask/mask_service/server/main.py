"""`specmask mask-service`: the process entry point (flags -> config -> server, SIGTERM -> graceful stop)."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import threading

from specmask.common import tracing
from specmask.common.config_flags import ConfigFlags
from specmask.common.log_format import configure_logging
from specmask.common.parent_watch import die_with_parent_from_env
from specmask.common.startup import StartupError, check_ports_free, check_tokenizer, port_flag
from specmask.mask_service.grammar.limits import GrammarLimits
from specmask.mask_service.server.config import MaskServiceConfig

logger = logging.getLogger(__name__)
TRACE_SERVICE_NAME = "specmask-mask-service"  # service.name of this process's spans


def mask_service_flags() -> ConfigFlags:
    """Every MaskServiceConfig field that declares a flag, as `specmask mask-service` takes it."""
    return ConfigFlags(MaskServiceConfig)


def limit_flags() -> ConfigFlags:
    """The grammar limits (MaskServiceConfig.grammar_limits), each its own flag."""
    return ConfigFlags(GrammarLimits)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mask_service_flags().add_to(parser)
    limit_flags().add_to(parser.add_argument_group("grammar limits (checked before any compile)"))


def config_from_args(args: argparse.Namespace) -> MaskServiceConfig:
    """The one place flags become configuration; ValueError for a bad value."""
    limits = GrammarLimits(**limit_flags().values(args))
    return MaskServiceConfig(**mask_service_flags().values(args), grammar_limits=limits)


def run(args: argparse.Namespace) -> int:
    die_with_parent_from_env()
    # Operator mistakes end here as one-line errors (specmask prints them), before loading anything.
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise StartupError(f"bad configuration: {exc}") from None
    configure_logging(config.log_level, config.log_format)
    try:
        tracing.check_installed(config.otlp_traces_endpoint)
    except RuntimeError as exc:
        raise StartupError(str(exc)) from None
    for source in config.tokenizers:
        check_tokenizer(source.path, "--tokenizer")
    check_ports_free(config.host, [("--port", port_flag(config.port)), ("--metrics-port", config.metrics_port)])
    from specmask.mask_service.server.server import build_service  # heavy imports only once the role is chosen

    handle = build_service(config)
    # After the compile zygote forked (build_service): it and its workers carry no exporter thread.
    tracing.configure(config.otlp_traces_endpoint, TRACE_SERVICE_NAME)
    # Tokenizers (hundreds of thousands of long-lived Python objects) are loaded:
    # move them out of the cyclic GC's reach, so a full collection on the hot path
    # scans only request-time objects, not every loaded vocabulary's.
    gc.collect()
    gc.freeze()
    # Handlers before the server starts: once it answers health checks as SERVING, a SIGTERM
    # (a probe-driven restart, a test) must drain, not take the default action.
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("signal %d: graceful shutdown", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    handle.server.start()
    if config.metrics_port is not None:
        from prometheus_client import start_http_server

        metrics_server, _ = start_http_server(config.metrics_port, addr=config.host)
        logger.info("metrics on http://%s:%d/metrics", config.host, metrics_server.server_port)
    logger.info("mask service serving on port %d", handle.port)
    done.wait()
    handle.stop(grace_s=config.shutdown_grace_s)
    tracing.shutdown()  # export the spans still buffered
    logger.info("mask service stopped")
    return 0
