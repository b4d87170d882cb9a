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

``--metrics-port`` is a separate Prometheus port, off by default (``/metrics`` is also on
the HTTP port). Everything else (``--mask-replicas``, ``--num-workers``, ``--max-queue``,
``--log-dir``, ...) is `up`'s, and so is the start-up (dev.launch): the ports checked
before anything starts, a mask-service token made for this start, Ray on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass

from specmask.common.config_flags import ConfigFlags
from specmask.common.proposer_kind import ProposerKind
from specmask.common.startup import StartupError
from specmask.orchestrator import config as cfg
from specmask.orchestrator.config import OrchestratorConfig
from specmask.orchestrator.dev.launch import Launch, PortFlag, add_stack_arguments, launch

SPECULATIVE_KEYS = frozenset({"model", "num_speculative_tokens", "method"})
SPECULATIVE_METHODS = (ProposerKind.DRAFT_MODEL, ProposerKind.NGRAM)


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
    method = data.get("method", ProposerKind.DRAFT_MODEL)
    if method not in SPECULATIVE_METHODS:
        methods = [str(m) for m in SPECULATIVE_METHODS]
        raise ValueError(f"--speculative-config: method {method!r} is not one of {methods}")
    k = data.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= cfg.DEFAULT_MAX_K):
        raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer in [0, {cfg.DEFAULT_MAX_K}]")
    draft = data.get("model")
    if method == ProposerKind.NGRAM:
        if draft is not None:
            raise ValueError(f'--speculative-config: method "{ProposerKind.NGRAM}" takes no model')
        draft = "none"
    elif draft is not None and not isinstance(draft, str):
        raise ValueError("--speculative-config: model must be a string")
    return Speculative(draft, k)


@functools.cache
def serve_flags() -> ConfigFlags:
    """OrchestratorConfig's flags under vLLM's names: ``--port`` is the HTTP API's."""
    return ConfigFlags(
        OrchestratorConfig,
        ("host", "http_port", "port", "served_model_name", "max_model_len", "metrics_port"),
        names={"http_port": "--port", "port": "--grpc-port"},
        helps={"served_model_name": "model id of the API (default: MODEL as given)"},
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="model directory, registered name, or Hugging Face id (cached)")
    serve_flags().add_to(parser)
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='e.g. \'{"model": "DIR|NAME|ID", "num_speculative_tokens": 4}\' or \'{"method": "ngram"}\'',
    )
    # --mask-replicas, --num-workers, --max-queue, --api-key(-file), --max-inflight-per-client,
    # --cors-origin, --log-dir, --log-level: `specmask up`'s, with its defaults.
    add_stack_arguments(parser)


def orchestrator_overrides(args: argparse.Namespace, speculative: Speculative) -> dict[str, object]:
    """The OrchestratorConfig fields `serve` sets beyond the flags it shares with `up`."""
    overrides: dict[str, object] = {
        "served_model_name": args.served_model_name or args.model,
        "max_model_len": args.max_model_len,
    }
    if speculative.k is not None:
        overrides["default_k"] = speculative.k
    return overrides


def run(args: argparse.Namespace) -> int:
    from specmask.gpu_worker.models.resolve import resolve_pair

    try:
        speculative = parse_speculative_config(args.speculative_config)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return launch(
        args,
        Launch(
            host=args.host,
            grpc=PortFlag("--grpc-port", args.grpc_port),
            http=PortFlag("--port", args.port),
            metrics=PortFlag("--metrics-port", args.metrics_port),
            models=lambda: resolve_pair(args.model, speculative.draft),
            orchestrator=orchestrator_overrides(args, speculative),
        ),
    )
