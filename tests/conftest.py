"""Process-wide test set-up, run before any test module is imported."""

from __future__ import annotations

import os

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
