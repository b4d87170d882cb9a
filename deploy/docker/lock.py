"""Regenerate the pinned requirement files under deploy/docker/requirements/.

Pins come from the project's tested virtualenv (`make venv`), so the images run
exactly the versions the test suite ran. For each image we take a few root
distributions and write the transitive closure of their runtime requirements,
one `name==version` a line. Run from the repository root:

    .venv/bin/python deploy/docker/lock.py          # rewrite
    .venv/bin/python deploy/docker/lock.py --check  # fail on drift (CI)
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

OUT_DIR = Path(__file__).parent / "requirements"

# xgrammar is installed separately with --no-deps: its wheel metadata requires
# torch, transformers and triton, but the mask service needs only the CPU grammar
# compiler/matcher (see deploy/README.md, "xgrammar and torch").
XGRAMMAR_IMPORT_DEPS = ["apache-tvm-ffi", "pydantic", "numpy", "typing-extensions", "transformers", "torch"]
SPECMASK_BASE = [
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "grpcio-status",
    "protobuf",
    "numpy",
    "prometheus-client",
    # The format checkers the end check needs (specmask/mask_service/grammar/schema_check.py).
    "jsonschema[format-nongpl]",
    "tqdm",
    "xxhash",
    # --otlp-traces-endpoint (the tracing extra; specmask/common/tracing.py): every role traces.
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-grpc",
]
# CPU torch comes from the PyTorch CPU index (no CUDA libraries, no triton).
CPU_TORCH_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"

IMAGES: dict[str, dict] = {
    "mask-service": {"roots": SPECMASK_BASE + XGRAMMAR_IMPORT_DEPS, "header": [CPU_TORCH_INDEX], "torch_label": "+cpu"},
    # The orchestrator is a Ray client: its ray and Python minor version must
    # equal the cluster's (gpu-worker image).
    "orchestrator": {
        # aiohttp, pydantic, jinja2: the OpenAI-compatible HTTP API (orchestrator/api/http).
        "roots": SPECMASK_BASE
        + XGRAMMAR_IMPORT_DEPS
        + ["ray", "tokenizers", "safetensors", "aiohttp", "pydantic", "jinja2"],
        "header": [CPU_TORCH_INDEX],
        "torch_label": "+cpu",
    },
    # torch here is the PyPI CUDA build; it pins its CUDA wheels and triton itself,
    # so they are not listed (cuda_only).
    "gpu-worker": {
        "roots": SPECMASK_BASE + XGRAMMAR_IMPORT_DEPS + ["ray", "tokenizers", "safetensors"],
        "header": [],
        "torch_label": "",
        "ray_extras": "default",
    },
}
# Build-time only; never copied into the runtime stage.
EXCLUDE = {"pip", "setuptools", "wheel", "xgrammar", "specmask"}
# What PyPI's torch (the CUDA build) requires beyond the CPU build: CUDA runtime wheels and
# triton. A venv holds either build (PyPI alone gives the CUDA one, see the Makefile), so the
# walk leaves them out and the files come out the same from both. The GPU image gets them as
# torch's own exact pins; the CPU images never install them.
CUDA_ONLY_PREFIXES = ("nvidia-", "cuda-")
CUDA_ONLY = {"triton"}


def cuda_only(name: str) -> bool:
    key = canonicalize_name(name)
    return key in CUDA_ONLY or key.startswith(CUDA_ONLY_PREFIXES)


class Dist(NamedTuple):
    """What the walk reads of a distribution: its version and its Requires-Dist lines."""

    version: str
    requires: list[str]


# name -> Dist; LookupError (PackageNotFoundError is one) for a name it does not hold.
Lookup = Callable[[str], Dist]


def installed(name: str) -> Dist:
    """A distribution of this interpreter's environment (the tested venv)."""
    dist = md.distribution(name)
    return Dist(dist.version, dist.requires or [])


def closure(roots: list[str], lookup: Lookup = installed) -> dict[str, str]:
    """name -> version for roots and everything they require at runtime.

    ``lookup`` is the environment read: the installed venv by default; tests pass the
    metadata of a resolve that has not been installed (tests/test_install_resolves.py).
    """
    seen: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [(Requirement(r).name, frozenset(Requirement(r).extras)) for r in roots]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        dist = lookup(name)
        if key in seen and not extras:
            continue
        seen[key] = dist.version
        for line in dist.requires:
            req = Requirement(line)
            env_extras = extras or {""}
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in env_extras):
                continue
            if key == "torch" and cuda_only(req.name):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return {k: v for k, v in seen.items() if k not in EXCLUDE}


def render(image: str, lookup: Lookup = installed) -> str:
    spec = IMAGES[image]
    pins = closure(spec["roots"], lookup)
    # The torch build is the image's, whichever one the venv holds: the base version with the
    # image's local label ("+cpu": the CPU index of the header; "": PyPI's CUDA build).
    pins["torch"] = pins["torch"].split("+")[0] + spec["torch_label"]
    lines = [f"# Generated by deploy/docker/lock.py for the {image} image. Do not edit.", *spec["header"]]
    if spec.get("ray_extras"):
        # Ray pods need ray[default] (dashboard, agent health endpoints KubeRay's
        # probes call). Those extras are not in the test venv, so pip resolves them.
        lines.append(f"ray[{spec['ray_extras']}]=={pins['ray']}")
    lines += [f"{name}=={version}" for name, version in sorted(pins.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file would change")
    args = parser.parse_args(argv)
    drift = []
    for image in IMAGES:
        path = OUT_DIR / f"{image}.txt"
        text = render(image)
        if args.check:
            if not path.exists() or path.read_text() != text:
                drift.append(str(path))
        else:
            path.write_text(text)
    if drift:
        print("out of date: " + ", ".join(drift), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
