"""Which implementation of a kernel op runs: Triton or the plain PyTorch reference.

Every op in `kernels/` takes `backend: Backend | None = None` and returns (or
carries) the backend that actually ran, so tests can assert it instead of
trusting the environment.

Resolution of `None` (DESIGN.md, kernels/):
* tensors on CUDA                      -> Triton (compiled);
* tensors on CPU, `TRITON_INTERPRET=1` -> Triton (interpreted; how CI tests it);
* tensors on CPU otherwise             -> the PyTorch reference.

Nothing here touches CUDA or imports Triton at import time (STYLE.md): the
Triton modules are imported lazily by each op, *after* the environment is read,
because Triton decides between compiling and interpreting when a kernel is
decorated.
"""

from __future__ import annotations

import enum
import os

import torch

__all__ = ["Backend", "resolve_backend", "triton_interpret_enabled"]


class Backend(enum.Enum):
    TRITON = "triton"
    REFERENCE = "reference"


def triton_interpret_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: Backend | None, device: torch.device) -> Backend:
    """Pick the backend for tensors living on `device`.

    An explicit TRITON on a CPU device without the interpreter is an error
    rather than a silent fallback: a test that asks for Triton must get Triton.
    """
    if backend is None:
        if device.type == "cuda" or triton_interpret_enabled():
            return Backend.TRITON
        return Backend.REFERENCE
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a kernels.backend.Backend or None, got {backend!r}")
    if backend is Backend.TRITON and device.type != "cuda" and not triton_interpret_enabled():
        raise ValueError(
            f"Backend.TRITON needs CUDA tensors or TRITON_INTERPRET=1; tensors are on {device}"
        )
    return backend
