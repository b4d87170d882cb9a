"""`specmask serve MODEL`: the whole stack of `specmask up`, with vLLM's command line.

``MODEL`` is a model directory, a registered name (``specmask models``) or a
Hugging Face id found in the local Hugging Face cache (``gpu_worker.models.hub``).
Flags keep vLLM's names and meanings where SpecMask has the same knob:

=========================  ==================================================
``--host``                 address both APIs bind (default 127.0.0.1)
``--port``                 the OpenAI-compatible HTTP API (default 8000)
``--grpc-port``            SpecMask's gRPC API (default 50051; -1 = off is not
                           offered: the gRPC server is the engine's front door)
``--served-model-name``    the model id clients send (default: MODEL as given)
``--max-model-len``        cap on prompt + output tokens
``--speculative-config``   JSON: ``model`` (draft dir/name/id, or ``"none"``),
                           ``num_speculative_tokens`` (k), ``method``
                           (``"draft_model"`` or ``"ngram"``: no draft model)
``--api-key``              ``--api-key-file`` too: the orchestrator's API keys
=========================  ==================================================

Everything else (``--metrics-port``, ``--mask-replicas``, ``--num-workers``,
``--max-queue``) is `up`'s. ``/metrics`` is also on the HTTP port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import dataclass

from specmask.orchestrator import config as cfg
from specmask.orchestrator.auth_keys import api_keys_from_args
from specmask.orchestrator.dev.local_stack import StackConfig
from specmask.orchestrator.main import LOG_FORMAT, add_fairness_and_auth_arguments

logger = logging.getLogger(__name__)

SPECULATIVE_KEYS = frozenset({"model", "num_speculative_tokens", "method"})
SPECULATIVE_METHODS = ("draft_model", "ngram")


@dataclass(frozen=True)
class Speculative:
    draft: str | None  # None = the model's default draft; "none" = no draft model
    k: int | None  # None = the server default


def parse_speculative_config(text: str | None) -> Speculative:
    """vLLM's ``--speculative-config`` JSON -> a draft model and k; ValueError names what is wrong."""
    if text is None:
        return Speculative(None, None)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(data) - SPECULATIVE_KEYS)
    if unknown:
        raise ValueError(f"--speculative-config: unsupported keys {unknown}; supported: {sorted(SPECULATIVE_KEYS)}")
    method = data.get("method", "draft_model")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"--speculative-config: method {method!r} is not one of {list(SPECULATIVE_METHODS)}")
    k = data.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= cfg.DEFAULT_MAX_K):
        raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer in [0, {cfg.DEFAULT_MAX_K}]")
    draft = data.get("model")
    if method == "ngram":
        if draft is not None:
            raise ValueError('--speculative-config: method "ngram" takes no model')
        draft = "none"
    elif draft is not None and not isinstance(draft, str):
        raise ValueError("--speculative-config: model must be a string")
    return Speculative(draft, k)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="model directory, registered name, or Hugging Face id (cached)")
    parser.add_argument("--host", default=cfg.DEFAULT_HOST, help="address the HTTP and gRPC APIs bind")
    parser.add_argument("--port", type=int, default=8000, help="OpenAI-compatible HTTP API port")
    parser.add_argument("--grpc-port", type=int, default=50051, help="SpecMask gRPC API port")
    parser.add_argument("--served-model-name", default=None, help="model id of the API (default: MODEL)")
    parser.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='e.g. \'{"model": "DIR|NAME|ID", "num_speculative_tokens": 4}\' or \'{"method": "ngram"}\'',
    )
    # --api-key / --api-key-file / --max-inflight-per-client / --cors-origin: the same as `specmask up`.
    add_fairness_and_auth_arguments(parser)
    parser.add_argument("--metrics-port", type=int, default=-1, help="separate Prometheus port (-1 = off)")
    parser.add_argument("--mask-replicas", type=int, default=1, help="mask-service processes")
    parser.add_argument("--num-workers", type=int, default=1, help="GPU worker actors")
    parser.add_argument("--max-queue", type=int, default=cfg.DEFAULT_MAX_QUEUE)
    parser.add_argument("--log-dir", default=None, help="where mask-service logs go (default: discarded)")
    parser.add_argument("--log-level", default="INFO")


def orchestrator_overrides(args: argparse.Namespace, speculative: Speculative) -> dict[str, object]:
    """The OrchestratorConfig fields `serve` sets beyond `up`'s."""
    overrides: dict[str, object] = {
        "host": args.host,
        "served_model_name": args.served_model_name or args.model,
        "max_model_len": args.max_model_len,
    }
    if speculative.k is not None:
        overrides["default_k"] = speculative.k
    overrides["api_keys"] = api_keys_from_args(args)
    overrides["max_inflight_per_client"] = args.max_inflight_per_client
    overrides["cors_origins"] = tuple(args.cors_origin)
    return overrides


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    from specmask.gpu_worker.models.errors import ModelError
    from specmask.gpu_worker.models.resolve import resolve_pair
    from specmask.orchestrator.dev.up import _up

    try:
        speculative = parse_speculative_config(args.speculative_config)
        overrides = orchestrator_overrides(args, speculative)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    try:
        target, draft = resolve_pair(args.model, speculative.draft)
    except ModelError as exc:
        logger.error("bad model: %s", exc)
        return 2
    stack = StackConfig(
        target_dir=target,
        draft_dir=draft,
        mask_replicas=args.mask_replicas,
        port=args.grpc_port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        num_workers=args.num_workers,
        log_dir=args.log_dir,
        restart_replicas=True,
    )
    try:
        asyncio.run(_up(stack, max_queue=args.max_queue, http_port=args.port, **overrides))
    except KeyboardInterrupt:
        return 130
    return 0
