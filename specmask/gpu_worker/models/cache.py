"""The model cache: one directory per registered name, a manifest with hashes, atomic publication.

Layout: ``<root>/<name>/`` (HF dir) with ``<root>/<name>/specmask-manifest.json``
holding the recipe and a sha256 per file. A build is written to a temporary
sibling directory and renamed into place only once complete and hashed, so an
interrupted build never leaves a directory that looks usable; a directory
whose manifest is missing, names another recipe or disagrees with the files is
rebuilt. A per-name file lock makes concurrent ``get``s build once.

Where: ``$SPECMASK_MODEL_CACHE`` if set, else the user's cache directory (XDG:
``$XDG_CACHE_HOME/specmask/models``, default ``~/.cache/specmask/models``), so a
model is fetched once per user, not once per working directory.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specmask.gpu_worker.models.errors import ModelError
from specmask.gpu_worker.models.registry import get_source
from specmask.gpu_worker.models.sources import sha256_file

logger = logging.getLogger(__name__)

CACHE_ENV = "SPECMASK_MODEL_CACHE"  # overrides default_cache_root()
XDG_CACHE_ENV = "XDG_CACHE_HOME"
MANIFEST_NAME = "specmask-manifest.json"
# Bump when the cache layout changes in a way a recipe cannot see.
CACHE_FORMAT_VERSION = 1


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/specmask/models``, or ``~/.cache/specmask/models`` (the XDG default)."""
    base = os.environ.get(XDG_CACHE_ENV) or str(Path.home() / ".cache")
    return Path(base) / "specmask" / "models"


def cache_root(root: Path | str | None = None) -> Path:
    if root is not None:
        return Path(root)
    return Path(os.environ.get(CACHE_ENV) or default_cache_root())


def verify(model_dir: Path, recipe: dict[str, Any]) -> str | None:
    """None when ``model_dir`` is a complete build of ``recipe``; otherwise why not (one line)."""
    manifest_path = model_dir / MANIFEST_NAME
    if not manifest_path.is_file():
        return "no manifest (incomplete or foreign directory)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    if manifest.get("format_version") != CACHE_FORMAT_VERSION or manifest.get("recipe") != recipe:
        return "built from another recipe"
    for rel, meta in manifest.get("files", {}).items():
        path = model_dir / rel
        if not path.is_file() or path.stat().st_size != meta["size"]:
            return f"{rel} is missing or has the wrong size"
        if sha256_file(path) != meta["sha256"]:
            return f"{rel} does not match its sha256"
    return None


def ensure_model(
    name: str, *, cache_root: Path | str | None = None, force: bool = False, progress: bool = True
) -> Path:
    """The cached directory of registered model ``name``, fetched/built first if needed."""
    source = get_source(name)
    root = globals()["cache_root"](cache_root)
    deps = {dep: ensure_model(dep, cache_root=root, progress=progress) for dep in source.dependencies()}
    final = root / name
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{name}.lock"):
        if final.is_dir() and not force:
            problem = verify(final, source.recipe())
            if problem is None:
                logger.info("model %s: cached at %s (manifest verified)", name, final)
                return final
            logger.warning("model %s: cached copy at %s not usable (%s); rebuilding", name, final, problem)
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=root))
        try:
            out = staging / "model"
            info = source.build(out, deps, progress=progress)
            files = {
                str(p.relative_to(out)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
                for p in sorted(out.rglob("*"))
                if p.is_file()
            }
            manifest = {
                "format_version": CACHE_FORMAT_VERSION,
                "name": name,
                "recipe": source.recipe(),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(time.monotonic() - started, 1),
                "info": info,
                "files": files,
            }
            # The manifest is written last: its presence marks a finished build.
            (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            if final.exists():
                shutil.rmtree(final)
            os.rename(out, final)  # same filesystem: atomic
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        logger.info("model %s: built in %.1f s at %s", name, time.monotonic() - started, final)
        return final


def cached_model(name: str, *, cache_root: Path | str | None = None) -> Path | None:
    """The verified cached directory of registered model ``name``, or None; never fetches or builds."""
    source = get_source(name)
    final = globals()["cache_root"](cache_root) / name
    if not final.is_dir():
        return None
    problem = verify(final, source.recipe())
    if problem is not None:
        logger.info("model %s: cached copy at %s not usable (%s)", name, final, problem)
        return None
    return final


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    path = Path(model_dir) / MANIFEST_NAME
    return json.loads(path.read_text()) if path.is_file() else None


@contextmanager
def _lock(path: Path):
    with path.open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as exc:
            raise ModelError(f"cannot lock {path} ({exc})") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
