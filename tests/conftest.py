"""Process-wide test set-up, run before any test module is imported."""

from __future__ import annotations

import os

import torch

# Triton chooses compile vs interpret when a function is decorated, including
# its own standard library at `import triton`; so the interpreter has to be on
# before anything (e.g. transformers) imports triton. Without CUDA the Triton
# code can only run interpreted; which backend each call uses is still chosen
# per call (kernels/backend.py). With CUDA, Triton compiles for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
