"""`specmask toy-models build [--out DIR] [--force] [--seed N]`."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from specmask.gpu_worker.toy.build import DEFAULT_OUT_DIR

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["build"], help="build: train the pair unless an up-to-date build exists")
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT_DIR,
        help=f"output dir (default: ./{DEFAULT_OUT_DIR}); gets target/, draft/, manifest.json",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if an up-to-date build exists")
    parser.add_argument("--seed", type=int, default=0, help="seed of corpus, tokenizer and training (default 0)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice); results are reproducible per thread count",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from specmask.gpu_worker.toy.build import ToyBuildConfig, build_toy_models

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = build_toy_models(
        args.out,
        ToyBuildConfig(seed=args.seed),
        force=args.force,
        progress=not args.quiet,
        num_threads=args.threads,
    )
    metrics = result.manifest["metrics"]
    print(f"target: {result.target_dir}")
    print(f"draft:  {result.draft_dir}")
    print(f"{'built' if result.rebuilt else 'cached'}; build took {result.manifest['build_seconds']} s")
    print("acceptance (grammar-blind, per position):")
    for split in ("acceptance_train_distribution", "acceptance_heldout_schemas"):
        print(f"  {split}: {json.dumps(metrics[split])}")
    return 0
