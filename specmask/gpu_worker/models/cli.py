"""`specmask models get NAME [--out DIR] [--force]`, `specmask models distill TARGET` and `specmask models list`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=["get", "distill", "list"],
        help="get: fetch/convert (cached); distill: build TARGET's small draft model here (cached); "
        "list: registered names",
    )
    parser.add_argument("name", nargs="?", default=None, help="registered model name (see `specmask models list`)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="cache root (default: $SPECMASK_MODEL_CACHE, else $XDG_CACHE_HOME/specmask/models or "
        "~/.cache/specmask/models)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when a verified copy is cached")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from specmask.gpu_worker.models.cache import ensure_model, read_manifest
    from specmask.gpu_worker.models.errors import ModelError
    from specmask.gpu_worker.models.registry import MODELS

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.action == "list":
        for name, source in sorted(MODELS.items()):
            print(f"{name}: {source.recipe()}")
        return 0
    if args.name is None:
        print(f"specmask models {args.action}: name a model (see `specmask models list`)", file=sys.stderr)
        return 2
    name = args.name
    if args.action == "distill":
        from specmask.gpu_worker.models.registry import DISTILLED_DRAFTS

        if name not in DISTILLED_DRAFTS:
            known = ", ".join(sorted(DISTILLED_DRAFTS))
            print(
                f"specmask models distill: no distilled draft is defined for {name!r} (known: {known})", file=sys.stderr
            )
            return 2
        name = DISTILLED_DRAFTS[name]
    try:
        path = ensure_model(name, cache_root=args.out, force=args.force, progress=not args.quiet)
    except ModelError as exc:
        print(f"specmask models get: {exc}", file=sys.stderr)
        return 1
    manifest = read_manifest(path) or {}
    print(f"{name}: {path} (built {manifest.get('built_at')}, {manifest.get('build_seconds')} s)")
    if args.action == "distill":
        info = manifest.get("info", {})
        print(
            f"  held-out greedy agreement (masked, unforced positions): {info.get('heldout_agreement_before')} "
            f"before training -> {info.get('heldout_agreement_after')} after; "
            f"used by default with {args.name} (or --draft {name})"
        )
    return 0
