"""Killable compile workers behind a bounded, per-owner fair queue (issue 14).

Each worker is a child process (mask_service.compile_worker) driven by one
dispatcher thread. A job runs under two limits: a wall-clock budget and a
resident-memory cap, both watched from here (RSS is read from /proc every
``_POLL_S``); a job that passes either is killed with its process, answered
with ``GrammarTooComplex`` and the worker is started afresh. So a pathological
grammar costs at most its budget on one worker, never the serving path, and a
SIGTERM to the service ends the workers with it.

Admission: at most ``max_queue`` jobs wait (``max_queue_per_owner`` per
owner); past either the caller gets ``CompileQueueFull`` (RESOURCE_EXHAUSTED,
retry later). Waiting jobs are served round-robin by owner, so one client
flooding distinct schemas delays another client's compile by at most one job
per worker, not by the whole flood.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from mask_service.compile_worker import read_frame, write_frame
from mask_service.errors import GrammarError, GrammarTooComplex, LimitExceeded
from mask_service.grammar import GrammarSpec
from mask_service.memory import rss_bytes
from mask_service.parent_watch import PARENT_PID_ENV

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # RSS / deadline checks while a job runs
_START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in a fresh worker; not charged to a job


class CompileQueueFull(LimitExceeded):
    """Too many compiles waiting (RESOURCE_EXHAUSTED): the client should back off and retry."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class CompileOutcome:
    seconds: float  # the trial compile's wall time in the worker
    compiled_bytes: int  # the engine's own size estimate of the compiled grammar
    peak_rss_bytes: int  # the worker's highest RSS seen during the job


@dataclass
class _Job:
    backend: str
    tok_key: Hashable
    spec: GrammarSpec
    owner: str
    future: Future[CompileOutcome] = field(default_factory=Future)


class _Worker:
    """One child process; used only by its dispatcher thread."""

    def __init__(self, index: int, env: dict[str, str]) -> None:
        self.index = index
        self._env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.tokenizers: set[Hashable] = set()
        self.busy = False

    @property
    def started(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.tokenizers = set()
        # No preexec_fn: Python between fork and exec in a gRPC process can abort
        # (see parent_watch); the child arranges its own parent-death signal.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mask_service.compile_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self._env,
        )
        msg = self._read(time.monotonic() + _START_TIMEOUT_S, None)
        if not (isinstance(msg, tuple) and msg and msg[0] == "ready"):
            self.kill()
            raise RuntimeError(f"compile worker {self.index} did not start")
        logger.info("compile worker %d started (pid %d)", self.index, self.proc.pid)

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()  # type: ignore[union-attr]

    def send(self, message: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        write_frame(self.proc.stdin, message)

    def _read(self, deadline: float, watch: Callable[[int], bool] | None) -> Any:
        """Wait for one frame until ``deadline``; ``watch(pid)`` returning False aborts.
        Returns the message, "timeout", "aborted" or None (the process died)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], min(_POLL_S, deadline - now))
            if ready:
                return read_frame(self.proc.stdout)
            if watch is not None and not watch(self.proc.pid):
                return "aborted"


class CompilePool:
    """Trial compiles in killable worker processes; see the module docstring."""

    def __init__(
        self,
        tokenizer_json: Callable[[Hashable], str],
        *,
        workers: int,
        budget_s: float,
        memory_cap_bytes: int,
        max_queue: int,
        max_queue_per_owner: int,
        threads_per_compile: int = 1,
        nice: int = 10,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._tokenizer_json = tokenizer_json
        self.budget_s = budget_s
        self.memory_cap_bytes = memory_cap_bytes
        self._max_queue = max_queue
        self._max_per_owner = max_queue_per_owner
        self._threads = threads_per_compile
        env = dict(os.environ)
        env[PARENT_PID_ENV] = str(os.getpid())
        env["SPECMASK_COMPILE_NICE"] = str(nice)
        # Kernel backstop at twice the polled cap (RSS polling acts first).
        env["SPECMASK_COMPILE_AS_EXTRA"] = str(2 * memory_cap_bytes if memory_cap_bytes else 0)
        self._workers = [_Worker(i, env) for i in range(workers)]
        self._cond = threading.Condition()
        self._queue: OrderedDict[str, deque[_Job]] = OrderedDict()  # owner -> waiting jobs, round-robin
        self._queued = 0
        self._closed = False
        self._warm = threading.Event()  # worker 0 started (or failed to)
        self._threads_list = [
            threading.Thread(target=self._dispatch, args=(w,), name=f"compile-dispatch-{w.index}", daemon=True)
            for w in self._workers
        ]
        for t in self._threads_list:
            t.start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the first worker has started (the service's explicit warm-up)."""
        return self._warm.wait(timeout_s)

    # -- figures (metrics, bench) --------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._queued

    @property
    def running(self) -> int:
        return sum(1 for w in self._workers if w.busy)

    def worker_rss_bytes(self) -> list[int]:
        return [rss_bytes(w.proc.pid) if w.proc is not None else 0 for w in self._workers]

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None]

    # -- admission ---------------------------------------------------------------
    def submit(self, backend: str, tok_key: Hashable, spec: GrammarSpec, owner: str = "") -> Future[CompileOutcome]:
        """Queue a trial compile; raises CompileQueueFull past the bounds."""
        job = _Job(backend, tok_key, spec, owner)
        with self._cond:
            if self._closed:
                raise CompileQueueFull("mask service is shutting down", retry_after_s=1.0)
            retry = max(1.0, self.budget_s * (self._queued + 1) / len(self._workers))
            if self._queued >= self._max_queue:
                raise CompileQueueFull(
                    f"compile queue full ({self._queued} grammars waiting); retry in ~{retry:.0f} s", retry
                )
            mine = self._queue.get(owner)
            if mine is not None and len(mine) >= self._max_per_owner:
                raise CompileQueueFull(
                    f"compile queue: {len(mine)} grammars of this client already waiting "
                    f"(limit {self._max_per_owner}); retry in ~{retry:.0f} s",
                    retry,
                )
            self._queue.setdefault(owner, deque()).append(job)
            self._queued += 1
            self._cond.notify_all()
        return job.future

    def _take(self, worker: _Worker) -> _Job | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                # A worker not yet started leaves jobs to started idle ones, so a
                # lightly used service runs one worker process, not all of them.
                others_idle = any(w.started and not w.busy for w in self._workers if w is not worker)
                if self._queued and (worker.started or not others_idle):
                    owner, jobs = next(iter(self._queue.items()))
                    job = jobs.popleft()
                    del self._queue[owner]
                    if jobs:
                        self._queue[owner] = jobs  # to the back: round-robin by owner
                    self._queued -= 1
                    worker.busy = True
                    return job
                self._cond.wait(1.0)

    # -- dispatch ------------------------------------------------------------------
    def _dispatch(self, worker: _Worker) -> None:
        if worker.index == 0:
            # Warm-up: one worker starts with the service (importing the engine takes
            # seconds), so the first compile does not wait for it; others start on demand.
            try:
                worker.start()
            except (OSError, RuntimeError):
                logger.exception("compile worker 0 failed to start; retrying on first compile")
            finally:
                self._warm.set()
        while True:
            job = self._take(worker)
            if job is None:
                return
            try:
                if job.future.set_running_or_notify_cancel():
                    try:
                        job.future.set_result(self._run(worker, job))
                    except BaseException as exc:  # handed to the waiting request
                        # After shutdown killed the worker under this job, say so (not a pipe error).
                        closing = CompileQueueFull("mask service is shutting down", retry_after_s=1.0)
                        job.future.set_exception(closing if self._closed else exc)
            finally:
                with self._cond:
                    worker.busy = False
                    self._cond.notify_all()

    def _run(self, worker: _Worker, job: _Job) -> CompileOutcome:
        if not worker.started:
            worker.start()
        if job.tok_key not in worker.tokenizers:
            worker.send(("tokenizer", job.tok_key, self._tokenizer_json(job.tok_key)))
            worker.tokenizers.add(job.tok_key)
        worker.send(("compile", job.backend, job.tok_key, job.spec, self._threads))
        peak = 0

        def under_cap(pid: int) -> bool:
            nonlocal peak
            rss = rss_bytes(pid)
            peak = max(peak, rss)
            return not self.memory_cap_bytes or rss <= self.memory_cap_bytes

        reply = worker._read(time.monotonic() + self.budget_s, under_cap)
        if isinstance(reply, tuple) and reply:
            if reply[0] == "ok":
                return CompileOutcome(float(reply[1]), int(reply[2]), peak)
            if reply[0] == "refused":
                raise GrammarError(str(reply[1]))
            worker.kill()  # the worker may be in a bad state after a failure
            raise GrammarTooComplex(f"grammar too complex: compile failed ({reply[1]})")
        worker.kill()
        if reply == "timeout":
            raise GrammarTooComplex(f"grammar too complex: compile exceeded {self.budget_s:g} s")
        if reply == "aborted":
            raise GrammarTooComplex(
                f"grammar too complex: compile exceeded the {self.memory_cap_bytes / 2**20:.0f} MiB memory cap"
            )
        raise GrammarTooComplex("grammar too complex: the compile worker died while compiling it")

    def shutdown(self) -> None:
        """Refuse new jobs, fail waiting ones, kill the workers (a running compile ends now)."""
        with self._cond:
            self._closed = True
            waiting = [j for jobs in self._queue.values() for j in jobs]
            self._queue.clear()
            self._queued = 0
            self._cond.notify_all()
        for job in waiting:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(CompileQueueFull("mask service is shutting down", retry_after_s=1.0))
        for w in self._workers:
            w.kill()
