"""`specmask orchestrator`: flags -> config -> server; SIGTERM/SIGINT -> graceful stop."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
from collections.abc import Callable

from specmask.common.log_format import LOG_FORMATS, configure_logging
from specmask.common.startup import PORT_OFF, StartupError, check_model_dir, check_ports_free, port_flag
from specmask.gpu_worker.config import DTYPES
from specmask.orchestrator import config as cfg
from specmask.orchestrator.api.http.tool_formats import ToolCallParser
from specmask.orchestrator.auth_keys import add_api_key_arguments, api_keys_from_args
from specmask.orchestrator.config import OrchestratorConfig
from specmask.orchestrator.reasoning import ReasoningParser
from specmask.orchestrator.validation import GrammarFallback

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host",
        default=cfg.DEFAULT_HOST,
        help="interface for the API and metrics: 127.0.0.1 (local default) keeps it off the network; "
        "containers pass 0.0.0.0 (or :: for IPv6), as the images and the Helm chart do",
    )
    parser.add_argument("--port", type=int, default=50051, help="API port (0 = pick a free one)")
    parser.add_argument(
        "--mask-service",
        required=True,
        metavar="ADDR[,ADDR...]",
        help="mask-service replica addresses (host:port), comma-separated; all go to every worker",
    )
    parser.add_argument(
        "--ray-address", default="local", help="Ray cluster address, or 'local' to start one in-process"
    )
    parser.add_argument(
        "--target",
        required=True,
        metavar="DIR|NAME",
        help="target model: an HF dir (with tokenizer) or a registered name (`specmask models list`; fetched once)",
    )
    parser.add_argument(
        "--draft", default=None, metavar="DIR|NAME", help="draft model dir or registered name (omit: no draft model)"
    )
    parser.add_argument("--num-workers", type=int, default=1, help="GPU worker actors")
    parser.add_argument(
        "--metrics-port", type=int, default=PORT_OFF, help="Prometheus /metrics port (-1 = off, 0 = pick a free one)"
    )
    parser.add_argument(
        "--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API port (0 = pick a free one, -1 = off)"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model id of the HTTP API (default: the --target dir's name)"
    )
    add_fairness_and_auth_arguments(parser)
    parser.add_argument(
        "--max-queue",
        type=int,
        default=cfg.DEFAULT_MAX_QUEUE,
        help="requests validating or waiting before RESOURCE_EXHAUSTED",
    )
    add_batch_and_memory_arguments(parser)
    parser.add_argument("--max-k", type=int, default=cfg.DEFAULT_MAX_K, help="largest k a request may ask for")
    parser.add_argument("--default-k", type=int, default=cfg.DEFAULT_K, help="k for requests that name none")
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=cfg.DEFAULT_MAX_TOKENS,
        help="output budget of requests that name none (default: the room the prompt leaves in the context)",
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output (default: the model's)")
    add_dtype_argument(parser)
    parser.add_argument("--device", default="auto", help="worker device: auto, cpu, cuda")
    parser.add_argument(
        "--worker-num-gpus",
        type=float,
        default=None,
        help="GPUs per worker actor (default: 1 if the Ray cluster has GPUs, else 0)",
    )
    parser.add_argument(
        "--step-timeout-s",
        type=float,
        default=cfg.DEFAULT_STEP_TIMEOUT_S,
        help="liveness limit: a worker is taken out when its heartbeat does not answer within it, or its "
        "progress stops for ten of them (a slow iteration alone is waited for); also bounds other worker calls",
    )
    parser.add_argument("--worker-start-timeout-s", type=float, default=cfg.DEFAULT_WORKER_START_TIMEOUT_S)
    parser.add_argument(
        "--worker-max-restarts",
        type=int,
        default=cfg.DEFAULT_WORKER_MAX_RESTARTS,
        help="times Ray restarts a crashed worker actor, and times the orchestrator replaces a lost one (killed, "
        "dead or stopped) with a new actor (-1 = always); a restarted worker rejoins placement",
    )
    parser.add_argument(
        "--worker-recovery-wait-s",
        type=float,
        default=cfg.DEFAULT_WORKER_RECOVERY_WAIT_S,
        help="with no healthy worker while a lost one is restarted: how long queued and new requests wait for it "
        "(0 = fail them at once)",
    )
    parser.add_argument(
        "--worker-torch-threads",
        type=int,
        default=cfg.DEFAULT_WORKER_TORCH_THREADS,
        help="torch threads per CPU worker (0 = every CPU the worker process may run on; GPU workers keep "
        "their default)",
    )
    parser.add_argument(
        "--step-prefill-tokens",
        type=int,
        default=cfg.DEFAULT_STEP_PREFILL_TOKENS,
        help="a new sequence's last N prompt tokens are fed by its first step, mixed into the batch's "
        "forwards; a longer prompt's head is prefilled in chunks within --max-iteration-tokens (1 = all "
        "but the last token)",
    )
    parser.add_argument(
        "--max-queued-prompt-tokens",
        type=int,
        default=cfg.DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
        help="prompt tokens waiting for a worker beyond which requests get RESOURCE_EXHAUSTED (0 = no bound)",
    )
    parser.add_argument(
        "--max-worker-prompt-tokens",
        type=int,
        default=cfg.DEFAULT_MAX_WORKER_PROMPT_TOKENS,
        help="prompt tokens of the requests placed on one worker; more wait in the queue (0 = no bound)",
    )
    parser.add_argument("--mask-deadline-s", type=float, default=cfg.DEFAULT_MASK_DEADLINE_S)
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=cfg.DEFAULT_SHUTDOWN_GRACE_S,
        help="on SIGTERM, streams get this long to finish, then end with a final message",
    )
    parser.add_argument(
        "--checked-max-attempts",
        type=int,
        default=cfg.DEFAULT_CHECKED_MAX_ATTEMPTS,
        help="checked mode: most generations one request may ask for (Grammar.max_attempts)",
    )
    add_grammar_fallback_argument(parser)
    add_reasoning_parser_argument(parser)
    add_tool_call_parser_argument(parser)
    parser.add_argument(
        "--schema-instruction",
        action="store_true",
        help="put the JSON Schema of a chat's structured output into a system message (off: the caller's "
        "messages are the prompt; a request opts in with schema_instruction)",
    )
    parser.add_argument(
        "--grammar-verdict-cache",
        type=int,
        default=cfg.DEFAULT_GRAMMAR_VERDICT_CACHE_ENTRIES,
        metavar="N",
        help="keep the mask tier's last N verdicts on grammars, so a request whose grammar was judged "
        "recently skips the ValidateGrammar round trip (0 = ask every time)",
    )
    parser.add_argument(
        "--grammar-verdict-ttl-s",
        type=float,
        default=cfg.DEFAULT_GRAMMAR_VERDICT_TTL_S,
        help="how long a kept verdict holds: the longest a change of the mask tier's limits takes to reach "
        "this orchestrator's admission",
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--log-format", default="text", choices=LOG_FORMATS, help="text (for people) or json (one object a line)"
    )


def add_batch_and_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """A worker's batch, iteration and KV-memory bounds, under SpecMask's and vLLM's names:
    shared by `specmask orchestrator`, `up` and `serve` (dests: max_batch, max_iteration_tokens,
    gpu_memory_utilization, kv_cache_bytes)."""
    parser.add_argument(
        "--max-batch",
        "--max-num-seqs",
        dest="max_batch",
        type=int,
        default=cfg.DEFAULT_MAX_BATCH,
        help="active sequences per worker (vLLM's --max-num-seqs)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="KV budget of each worker (CUDA): the fraction of its device's memory it may use, less the "
        "loaded models and an activation reserve; requests wait in the queue until their prompt + max_tokens "
        "fit beside the running ones (docs/models.md). Default: no budget",
    )
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="KV budget of each worker in bytes, on any device (instead of --gpu-memory-utilization)",
    )
    parser.add_argument(
        "--max-iteration-tokens",
        "--max-num-batched-tokens",
        dest="max_iteration_tokens",
        type=int,
        default=cfg.DEFAULT_MAX_ITERATION_TOKENS,
        help="target tokens one worker iteration may process, each weighted by the keys it attends over "
        "(a token deep in a long prompt counts more than one): running sequences' decode rows first, then "
        "chunks of prompts being prefilled, in the same forward; 0 = by device, 512 on a GPU and 48 on a "
        "CPU (docs/scheduling.md); vLLM's --max-num-batched-tokens, but weighted",
    )


def add_grammar_fallback_argument(parser: argparse.ArgumentParser) -> None:
    """``--grammar-fallback``: shared by `specmask orchestrator`, `up` and `serve`."""
    parser.add_argument(
        "--grammar-fallback",
        choices=[f.value for f in GrammarFallback],
        default=cfg.DEFAULT_GRAMMAR_FALLBACK.value,
        help="a JSON Schema no engine enforces exactly, for a request that does not say (guided_checked / "
        "Grammar.checked unset): checked = generate under a relaxation, check the output against the schema, "
        "resample (never an invalid output returned); refuse = INVALID_ARGUMENT",
    )


def add_reasoning_parser_argument(parser: argparse.ArgumentParser) -> None:
    """``--reasoning-parser``: shared by `specmask orchestrator`, `up` and `serve` (vLLM's flag)."""
    parser.add_argument(
        "--reasoning-parser",
        choices=[p.value for p in ReasoningParser],
        default=None,
        help="the model thinks before it answers, in this family's format: the thinking is free, any "
        "grammar applies to the answer after it, and the HTTP API returns the thinking as "
        "reasoning / reasoning_content apart from content (docs/openai-api.md)",
    )


def add_tool_call_parser_argument(parser: argparse.ArgumentParser) -> None:
    """``--tool-call-parser``: shared by `specmask orchestrator`, `up` and `serve` (vLLM's flag)."""
    parser.add_argument(
        "--tool-call-parser",
        choices=[p.value for p in ToolCallParser],
        default=ToolCallParser.AUTO.value,
        help="the format the model writes tool calls in (the HTTP API's tools); auto = read from the "
        "chat template, Hermes when it shows none (docs/openai-api.md)",
    )


def reasoning_parser_of(args: argparse.Namespace) -> ReasoningParser | None:
    return ReasoningParser(args.reasoning_parser) if args.reasoning_parser else None


def add_fairness_and_auth_arguments(parser: argparse.ArgumentParser) -> None:
    """The per-client cap, API keys and CORS: on every command that serves the public APIs."""
    parser.add_argument(
        "--max-inflight-per-client",
        type=int,
        default=cfg.AUTO_INFLIGHT_PER_CLIENT,
        help="requests one end client (API key, else specmask-client metadata / X-SpecMask-Client header, "
        "else address) may have in flight; past it RESOURCE_EXHAUSTED (-1 = every batch slot plus half "
        "the admission queue, 0 = no limit)",
    )
    add_api_key_arguments(parser)
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="an origin browsers may call the HTTP API from (repeatable; '*' = any; default: no CORS)",
    )


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype``, as vLLM names it: every command that loads a model takes it."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="model weights and KV cache: auto = the checkpoint's dtype on CUDA (bfloat16 for "
        "Llama 3, Qwen, Mistral), float32 on a CPU",
    )


def config_from_args(args: argparse.Namespace) -> OrchestratorConfig:
    """The one place flags become configuration."""
    return OrchestratorConfig(
        target_dir=args.target,
        draft_dir=args.draft,
        mask_service_addresses=tuple(a.strip() for a in args.mask_service.split(",") if a.strip()),
        host=args.host,
        port=args.port,
        ray_address=args.ray_address,
        num_workers=args.num_workers,
        metrics_port=port_flag(args.metrics_port),
        http_port=port_flag(args.http_port),
        served_model_name=args.served_model_name,
        max_queue=args.max_queue,
        max_inflight_per_client=args.max_inflight_per_client,
        api_keys=api_keys_from_args(args),
        cors_origins=tuple(args.cors_origin),
        max_batch=args.max_batch,
        max_k=args.max_k,
        default_k=args.default_k,
        default_max_tokens=args.default_max_tokens,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        device=args.device,
        worker_num_gpus=args.worker_num_gpus,
        step_timeout_s=args.step_timeout_s,
        worker_start_timeout_s=args.worker_start_timeout_s,
        worker_max_restarts=args.worker_max_restarts,
        worker_recovery_wait_s=args.worker_recovery_wait_s,
        worker_torch_threads=args.worker_torch_threads,
        step_prefill_tokens=args.step_prefill_tokens,
        max_iteration_tokens=args.max_iteration_tokens,
        max_queued_prompt_tokens=args.max_queued_prompt_tokens,
        max_worker_prompt_tokens=args.max_worker_prompt_tokens,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        mask_deadline_s=args.mask_deadline_s,
        shutdown_grace_s=args.shutdown_grace_s,
        checked_max_attempts=args.checked_max_attempts,
        grammar_fallback=GrammarFallback(args.grammar_fallback),
        reasoning_parser=reasoning_parser_of(args),
        tool_call_parser=ToolCallParser(args.tool_call_parser),
        schema_instruction=args.schema_instruction,
        grammar_verdict_cache_entries=args.grammar_verdict_cache,
        grammar_verdict_ttl_s=args.grammar_verdict_ttl_s,
        worker_log_level=args.log_level,
        log_format=args.log_format,
    )


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
    check_model_dir(config.target_dir, "--target")
    if config.draft_dir is not None:
        check_model_dir(config.draft_dir, "--draft", tokenizer=False)
    check_ports_free(
        config.host,
        [("--port", config.port), ("--metrics-port", config.metrics_port), ("--http-port", config.http_port)],
    )
    try:
        from specmask.orchestrator.worker_pool import connect_ray

        connect_ray(config.ray_address)  # here, on the main thread: create_server's call is then a no-op
    except (ConnectionError, TimeoutError, ValueError) as exc:
        raise StartupError(f"cannot join the Ray cluster at {config.ray_address}: {exc}") from None
    try:
        asyncio.run(serve(config))
    finally:
        shutdown_local_ray(config)
    return 0
