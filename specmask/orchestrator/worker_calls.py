"""Awaiting Ray calls to a GPU worker on the serving loop: always bounded, and a worker's
exception told in one line (docs/design.md, "Who runs what").

Shared by the step loop (engine.py) and worker supervision (supervision.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.exceptions import RayTaskError

from specmask.gpu_worker.types import UnknownSequenceError

logger = logging.getLogger(__name__)


async def ray_get(ref: Any, timeout_s: float) -> Any:
    """Await a Ray ObjectRef on the running loop, with a timeout (never a bare ray.get)."""
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)


async def await_remove(index: int, ref: Any, timeout_s: float) -> None:
    """Await worker ``index``'s ``remove()``; ids the worker no longer holds are expected, not errors.

    A request can finish on the worker (grammar complete, length) in the
    same step in which the client cancels it, or be refused by add() while
    its cancel is queued; the worker frees the rest and names those.
    """
    try:
        await ray_get(ref, timeout_s)
    except RayTaskError as exc:
        if not isinstance(getattr(exc, "cause", None), UnknownSequenceError):
            raise
        logger.debug("worker %d: %s", index, exc.cause)


def describe(exc: BaseException) -> str:
    """One line for a client: the worker-side exception, not Ray's traceback."""
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
