"""Exit with the process that started us (local stacks: `specmask up`, `make demo`, tests).

The spawner cannot arrange this between fork and exec: Python code there
(``preexec_fn``) runs gRPC's fork handlers in a child of a process full of gRPC
threads, which can abort it and, through an alarm that survives exec, kill the
started service 3 s later (seen in CI; the full story is in specmask/proto/__init__.py).
So the spawner only sets ``SPECMASK_PARENT_PID`` and the child asks the kernel
itself, first thing in ``main``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PARENT_PID_ENV = "SPECMASK_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent_from_env() -> None:
    """If ``SPECMASK_PARENT_PID`` is set: SIGTERM (a graceful stop) when that parent dies (Linux)."""
    value = os.environ.get(PARENT_PID_ENV)
    if not value or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    # The parent may have died before the prctl above: then nobody will signal us.
    if str(os.getppid()) != value:
        raise SystemExit(f"parent process {value} is gone; exiting")
