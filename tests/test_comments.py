"""Comments and docstrings in specmask/ say why, not what one run once measured.

A timing in a comment was true on one machine on one day and goes stale silently; the
current figures live in docs/benchmarks.md, with the date, commit, machine and command.
This scans every comment token and docstring for measured figures (a number with a time
unit, a throughput, an "Nx faster") and for citations of README sections that no longer
exist. ``ALLOWED`` holds the few figures that are definitions, not measurements: a
default or a dependency's fixed constant that the text names so the reader can check it.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "specmask"

_UNITS = r"(?:ns|µs|us|ms|s|sec|secs|seconds|min|mins|minutes|h|hours|GB/s|MB/s|tok/s|tokens/s)"
MEASURED = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?" + _UNITS + r"(?![\w/])"  # 6.5 ms, 30 s, 5,000 tok/s
    r"|\d+(?:\.\d+)?\s?(?:x|×)\s(?:faster|slower|the|slow-down|speed-up|speedup)"  # 1.38x faster, 10x the
    r"|\d+\.\d+×"  # 1.30×
)
README_CITATION = re.compile(r"README,?\s+\"([^\"]+)\"")

# (path relative to the repository, the figure's text): definitions a comment names.
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        # Abseil's abort handler arms a fixed 3 s alarm (a dependency's constant).
        ("specmask/proto/__init__.py", "3 s"),
        ("specmask/common/parent_watch.py", "3 s"),
        # gRPC's default reconnect backoff cap, and the caps this code sets.
        ("specmask/mask_service/client/mask_client.py", "120 s"),
        ("specmask/mask_service/client/mask_client.py", "2 s"),
        ("specmask/orchestrator/dev/replica_supervisor.py", "2 s"),
        # Ray's fixed GCS waits that the environment below overrides.
        ("specmask/orchestrator/worker_pool.py", "30 s"),
        # The compile stall backstop's default: max(30 s, 4x the CPU budget).
        ("specmask/mask_service/server/config.py", "30 s"),
        ("specmask/mask_service/server/config.py", "4x the"),
        # DEFAULT_SESSION_TTL_S = 600.0, in minutes.
        ("specmask/mask_service/server/config.py", "10 min"),
        # The router's dead-replica cool-down (DEAD_REPLICA_COOLDOWN_S).
        ("specmask/mask_service/client/mask_client.py", "5 s"),
        # The router's periodic DNS lookup interval (DNS_REFRESH_S).
        ("specmask/mask_service/client/router.py", "10 s"),
        # The wording speedup_words returns, quoted as its example.
        ("specmask/orchestrator/dev/demo.py", "1.40x faster"),
        ("specmask/orchestrator/dev/demo.py", "1.16x slower"),
    }
)


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "gen" not in p.relative_to(PACKAGE).parts)


def comment_texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment token and every line of every docstring."""
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            doc = first.value.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else None
            if isinstance(doc, str):
                out.extend((first.lineno + i, line) for i, line in enumerate(doc.splitlines()))
    return out


def measured_figures(text: str) -> list[str]:
    return [m.group(0) for m in MEASURED.finditer(text)]


def test_the_pattern_finds_measurements_and_spares_plain_numbers() -> None:
    # Every kind the scan is for, and text it must leave alone, so the scan cannot pass vacuously.
    found = [
        "took 136 ms for 1 token",
        "~200 us per row",
        "~3 µs of GIL-held time",
        "0.16 s compile, 4.7 s serialise",
        "a ~100 ms full GC pass",
        "bench.e2e 1.38x faster",
        "read as >5,000 tok/s",
        "costs ~10x the compile",
        "**1.30×** over",
        "for ~11 minutes",
        "~20 min on 2 CPU cores",
        "a 0.5x slow-down",
    ]
    for text in found:
        assert measured_figures(text), text
    for text in ("k+1 rows", "a 2-core host", "Llama-3 vocab", "4 bytes/token", "sha256 over", "SmolLM2-135M"):
        assert not measured_figures(text), text


def test_no_measured_figures_in_comments() -> None:
    stale: list[str] = []
    for path in _sources():
        rel = path.relative_to(REPO_ROOT).as_posix()
        for line, text in comment_texts(path.read_text(encoding="utf-8")):
            for figure in measured_figures(text):
                if (rel, figure) not in ALLOWED:
                    stale.append(f"{rel}:{line}: {figure!r} in {text.strip()!r}")
    assert not stale, (
        "measured figures in comments (record them in docs/benchmarks.md, keep the why here):\n" + "\n".join(stale)
    )


def test_allowed_figures_still_stand() -> None:
    # An allow-list entry whose figure is gone is a stale exemption.
    unused = set(ALLOWED)
    for path in _sources():
        rel = path.relative_to(REPO_ROOT).as_posix()
        for _, text in comment_texts(path.read_text(encoding="utf-8")):
            for figure in measured_figures(text):
                unused.discard((rel, figure))
    assert not unused, f"allow-list entries no comment uses any more: {sorted(unused)}"


def test_readme_citations_name_existing_sections() -> None:
    headings = {
        line.lstrip("#").strip()
        for line in (REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    }
    broken: list[str] = []
    for path in _sources():
        rel = path.relative_to(REPO_ROOT).as_posix()
        for line, text in comment_texts(path.read_text(encoding="utf-8")):
            broken.extend(
                f"{rel}:{line}: README {m.group(1)!r}"
                for m in README_CITATION.finditer(text)
                if m.group(1) not in headings
            )
    assert not broken, "comments cite README sections that do not exist:\n" + "\n".join(broken)
