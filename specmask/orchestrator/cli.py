"""The `specmask` console script: one subcommand per process role.

Subcommand modules are imported lazily so that, e.g., the slim mask-service
image (no torch, no Ray) can run `specmask mask-service` without importing
model code. Each module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module path, one-line help). A registry, not an if-chain:
# adding a role is one line here plus a module with add_arguments/run.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "mask-service": ("specmask.mask_service.server.main", "run the CPU grammar-mask gRPC service"),
    "toy-models": ("specmask.gpu_worker.toy.cli", "build the small local target/draft model pair"),
    "models": ("specmask.gpu_worker.models.cli", "fetch and convert a registered real model (cached, verified)"),
    "orchestrator": ("specmask.orchestrator.main", "run the orchestrator gRPC API"),
    "up": ("specmask.orchestrator.dev.up", "start the whole local stack (mask service, Ray worker, orchestrator)"),
    "serve": ("specmask.orchestrator.dev.serve", "serve MODEL over the OpenAI API with vLLM's flag names (like `up`)"),
    "generate": ("specmask.orchestrator.generate_cli", "send a generation request to an orchestrator"),
    "demo": (
        "specmask.orchestrator.dev.demo",
        "build the toy pair, bring the stack up, run schema-constrained requests",
    ),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmask", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"specmask {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Only import the module of the subcommand actually invoked (and only to
    # register its flags); `specmask --help` lists every subcommand without imports.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_path, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_path)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specmask")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    from specmask.common.startup import EXIT_USAGE, StartupError

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except StartupError as exc:  # an operator mistake: one line, no traceback
        print(f"specmask {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
