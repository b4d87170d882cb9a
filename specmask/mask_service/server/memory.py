"""Memory accounting of a mask-service replica: measured RSS, and the guard that sheds new sessions.

The figures are measured, not estimated: resident set sizes from /proc of the
serving process and of its compile workers (they share the pod's memory). The
guard refuses new sessions (RESOURCE_EXHAUSTED) once that total passes a limit
set below the point where the kernel's OOM killer would act, so a replica
under memory pressure degrades into fast refusals instead of being killed with
every session it holds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")
# With no explicit limit, shed at this share of the cgroup's memory.max: the
# headroom covers one more compile and the sessions already open.
CGROUP_SHED_FRACTION = 0.85


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def cgroup_memory_limit() -> int | None:
    """This container's memory limit (cgroup v2, then v1), or None when unlimited."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 reports "unlimited" as a huge number
            return int(text)
    return None


def shed_limit(configured_bytes: int) -> int | None:
    """The RSS total past which new sessions are shed: the configured bytes if > 0,
    else a share of the cgroup limit, else None (no guard)."""
    if configured_bytes > 0:
        return configured_bytes
    limit = cgroup_memory_limit()
    return int(limit * CGROUP_SHED_FRACTION) if limit else None


class MemoryGuard:
    """``guard()`` -> a reason to shed new sessions, or None. ``worker_pids`` lists helper processes."""

    def __init__(self, limit_bytes: int, worker_pids: Callable[[], list[int]] = list) -> None:
        self.limit_bytes = limit_bytes
        self._worker_pids = worker_pids

    def total_bytes(self) -> int:
        return rss_bytes() + sum(rss_bytes(p) for p in self._worker_pids())

    def __call__(self) -> str | None:
        total = self.total_bytes()
        if total <= self.limit_bytes:
            return None
        return f"replica memory {total / 2**20:.0f} MiB is over its limit of {self.limit_bytes / 2**20:.0f} MiB"
