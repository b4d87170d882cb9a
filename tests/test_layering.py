"""Imports run one way only: from a higher layer down to a lower one, never back up.

The layers, lowest first: ``proto`` and ``common`` (wire contract, shared plumbing),
``mask_service`` (grammar policy, then the server and client on top of it),
``kernels``, ``gpu_worker``, ``orchestrator``. Read from the source with ``ast``,
so a function-level import counts the same as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specmask"

# What each part may import from specmask besides itself.
ALLOWED: dict[str, set[str]] = {
    "proto": set(),
    "common": set(),
    "mask_service.grammar": {"proto", "common", "mask_service"},
    "mask_service.client": {"proto", "common", "mask_service"},
    "mask_service.server": {"proto", "common", "mask_service", "mask_service.grammar", "mask_service.client"},
    "mask_service": {"proto", "common"},
    "kernels": set(),
    "gpu_worker": {"proto", "common", "mask_service", "mask_service.client", "kernels"},
    "orchestrator": {
        "proto",
        "common",
        "mask_service",
        "mask_service.client",
        "mask_service.grammar",  # the end check uses the grammar policy's strict-schema reading
        "kernels",
        "gpu_worker",
    },
}


def _part(module: str) -> str:
    """The ALLOWED key a dotted name under specmask belongs to (longest match)."""
    rest = module.removeprefix("specmask.")
    for key in sorted(ALLOWED, key=len, reverse=True):
        if rest == key or rest.startswith(key + "."):
            return key
    return rest.split(".")[0]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return [n for n in names if n == "specmask" or n.startswith("specmask.")]


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "gen" not in p.relative_to(PACKAGE).parts)


def test_every_part_has_a_rule() -> None:
    parts = {_part("specmask." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)) for p in SOURCES}
    parts.discard("__init__")
    assert parts <= set(ALLOWED), parts - set(ALLOWED)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    own = _part("specmask." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
    if own == "__init__":
        return
    bad = [m for m in _imports(path) if (p := _part(m)) != own and p not in ALLOWED[own] and m != "specmask"]
    assert not bad, f"{path.relative_to(PACKAGE)} ({own}) imports up or sideways: {bad}"
