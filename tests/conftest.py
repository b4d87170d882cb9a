"""Process-wide test set-up, run before any test module is imported."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Triton chooses compile vs interpret when a function is decorated, including
# its own standard library at `import triton`; so the interpreter has to be on
# before anything (e.g. transformers) imports triton. Without CUDA the Triton
# code can only run interpreted; which backend each call uses is still chosen
# per call (specmask/kernels/backend.py). With CUDA, Triton compiles for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The model cache is the user's (XDG, gpu_worker.models.cache); a checkout that already holds
# real models in its own .specmask/models (from before the cache moved) keeps using them in tests.
_CHECKOUT_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".specmask", "models")
if os.path.isdir(_CHECKOUT_MODELS):
    os.environ.setdefault("SPECMASK_MODEL_CACHE", _CHECKOUT_MODELS)

# Fixtures shared across test directories (a plugin module each).
pytest_plugins = ["tests.tracing_fixtures"]


@pytest.fixture(autouse=True)
def _root_logging_kept() -> Iterator[None]:
    """A server entry point run in-process (``cli.main``) sets up the process's root logging as
    its own process would: a StreamHandler on the stderr of that moment, pytest's capture, which
    closes with the test. Left in place, every later log line in this worker fails with "I/O
    operation on closed file" and buries real failures in the output. So plain StreamHandlers a
    test left on the root logger go, and the root level comes back (pytest's own handlers are
    subclasses, set up per phase, and stay)."""
    root = logging.getLogger()
    level = root.level
    yield
    for handler in [h for h in root.handlers if type(h) is logging.StreamHandler]:
        root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model's converted directory; skipped when it is not cached (tests never
    download weights: `specmask models get smollm2-135m-instruct` does)."""
    from specmask.gpu_worker.models.cache import MANIFEST_NAME, cache_root
    from specmask.gpu_worker.models.registry import DEFAULT_MODEL

    root = cache_root()
    path = (root if root.is_absolute() else Path(__file__).resolve().parents[1] / root) / DEFAULT_MODEL
    if not (path / MANIFEST_NAME).is_file():
        pytest.skip(f"{DEFAULT_MODEL} is not cached at {path}; run `specmask models get {DEFAULT_MODEL}`")
    return path


# Units of work for pytest-xdist (`make test` runs the suite on several workers): a test file is
# a unit, so its module fixtures (a mask service, a stack of its own) are built once; tests/e2e is
# one unit, so its package-scoped stack (Ray, mask replicas, workers) starts once per run, not once
# per worker. Units that start processes go first: they are the long ones, and started last they
# would leave one worker running alone at the end.
_SHARED_STACK_PACKAGE = "tests/e2e"
_PROCESS_LEVEL = ("tests/e2e", "tests/benches/", "tests/deploy/")  # "tests/e2e": every tests/e2e* package


def _unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return _SHARED_STACK_PACKAGE if path.startswith(_SHARED_STACK_PACKAGE + "/") else path


def _unit_rank(unit: str) -> int:
    if unit == _SHARED_STACK_PACKAGE:
        return 0
    return 1 if unit.startswith(_PROCESS_LEVEL) else 2


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown when xdist is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            # The base class hands out the queue's first unit: put the best-ranked one there
            # (min keeps collection order among equals).
            first = min(self.workqueue, key=_unit_rank)
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return UnitScheduling(config, log)
