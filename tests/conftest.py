"""Process-wide test set-up, run before any test module is imported."""

from __future__ import annotations

import os
from pathlib import Path

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
