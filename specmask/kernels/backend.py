"""Which implementation of a kernel op runs: Triton or the plain PyTorch reference.

Every op in `kernels/` takes `backend: Backend | None = None` and returns (or
carries) the backend that actually ran, so tests can assert it instead of
trusting the environment.

Resolution of `None` (docs/design.md, kernels/):
* tensors on CUDA                                  -> Triton (compiled);
* tensors on CPU, `SPECMASK_KERNEL_BACKEND=triton`  -> Triton (interpreted; needs
  `TRITON_INTERPRET=1`, which is how CI tests the Triton code);
* tensors on CPU otherwise                         -> the PyTorch reference.

Why two variables: Triton decides between compiling and interpreting when a
function is decorated, and that includes Triton's own standard library
(`tl.max`, `tl.argmax`, ...), decorated when `triton` is first imported. So
`TRITON_INTERPRET=1` must be set process-wide before anything imports triton
(tests/conftest.py does that), while the *choice* of backend for a given call
is made per call: most CPU tests want the fast reference, kernel tests want
the interpreted Triton code.

Nothing here touches CUDA or imports Triton at import time: the
Triton modules are imported lazily by each op, *after* the environment is read,
because Triton decides between compiling and interpreting when a kernel is
decorated.
"""

from __future__ import annotations

import enum
import os

import torch

__all__ = ["BACKEND_ENV", "Backend", "cpu_default_is_triton", "resolve_backend", "triton_interpret_enabled"]

# Selects the backend for CPU tensors when the caller passes backend=None.
BACKEND_ENV = "SPECMASK_KERNEL_BACKEND"


class Backend(enum.Enum):
    TRITON = "triton"
    REFERENCE = "reference"


def triton_interpret_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def cpu_default_is_triton() -> bool:
    """True when `SPECMASK_KERNEL_BACKEND=triton` asks for Triton on CPU tensors."""
    return os.environ.get(BACKEND_ENV, "").lower() == Backend.TRITON.value


def resolve_backend(backend: Backend | None, device: torch.device) -> Backend:
    """Pick the backend for tensors living on `device`.

    An explicit TRITON on a CPU device without the interpreter is an error
    rather than a silent fallback: a test that asks for Triton must get Triton.
    """
    if backend is None:
        if device.type == "cuda":
            return Backend.TRITON
        backend = Backend.TRITON if cpu_default_is_triton() else Backend.REFERENCE
    elif not isinstance(backend, Backend):
        raise TypeError(f"backend must be a kernels.backend.Backend or None, got {backend!r}")
    if backend is Backend.TRITON and device.type != "cuda" and not triton_interpret_enabled():
        raise ValueError(f"Backend.TRITON needs CUDA tensors or TRITON_INTERPRET=1; tensors are on {device}")
    return backend
