"""Killable compile workers behind a bounded, per-owner fair queue.

Owns ``CompilePool``: one dispatcher thread per worker process (compile_worker, forked from
the pool's compile_zygote), the three limits it watches every ``_POLL_S`` (a CPU-time budget
and a resident-memory cap: "too complex", cached by the caller; a stall backstop:
``CompileStarved``, retryable, never cached), restarts after a kill, and admission (a shared
queue with a guaranteed share per owner, served round-robin by owner). Why CPU time, why the
parent polls it, and the admission rules: docs/operations.md, "Killable compiles".
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

from specmask.common.grammar_spec import GrammarSpec
from specmask.common.parent_watch import PARENT_PID_ENV
from specmask.mask_service.errors import GrammarError, GrammarTooComplex, LimitExceeded
from specmask.mask_service.server.compile_worker import read_frame, write_frame
from specmask.mask_service.server.compile_zygote import ForkedProcess, Zygote
from specmask.mask_service.server.compile_zygote import supported as zygote_supported
from specmask.mask_service.server.memory import rss_bytes

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # RSS / CPU / deadline checks while a job runs
# The stall backstop when none is configured: how long a worker's CPU time may
# stand still before its compile is ended as starved. A niced worker beside
# saturating processes still gets CPU every scheduler period, so a stall this
# long means a stopped or blocked worker, not a busy box.
_MIN_WALL_BUDGET_S = 30.0
_WALL_BUDGET_FACTOR = 4.0


def default_wall_budget_s(cpu_budget_s: float) -> float:
    return max(_MIN_WALL_BUDGET_S, _WALL_BUDGET_FACTOR * cpu_budget_s)


# Compile workers' priority: below serving (draft masks, commits win the CPU), but a
# plain nice, not SCHED_IDLE: the idle class gets no CPU while anything else is
# runnable, so on a saturated box (a mask pod busy serving) no compile would finish.
# Nice 5 against nice-0 work is a weight of 335 to 1024: a guaranteed share of about
# a quarter of a core per competing process, and the CPU budget still bounds it.
DEFAULT_WORKER_NICE = 5

_START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in a fresh worker; not charged to a job


class CompileQueueFull(LimitExceeded):
    """Too many compiles waiting (RESOURCE_EXHAUSTED): the client should back off and retry."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class CompileStarved(CompileQueueFull):
    """The compile got too little CPU to finish within the wall-clock backstop (RESOURCE_EXHAUSTED).

    The grammar was not judged: the box was busy (compile workers run at the lowest
    priority) or the worker stopped. Retrying later can succeed, so it is never cached,
    and it is no sign of a dead replica."""


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, all its threads (None where /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # Fields after the parenthesised command name (which may hold spaces):
            # state is field 3, utime 14, stime 15.
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


class _StallWatch:
    """Ends a wait once a process's CPU time has stood still for ``window_s`` ("stalled").

    ``deadline`` is far off where /proc answers (progress is what counts), else
    ``window_s`` from now (a plain wall-clock backstop)."""

    # An upper bound on any one wait, so a watch that never stalls still ends.
    _FAR_S = 24 * 3600.0

    def __init__(self, pid: int, window_s: float) -> None:
        self._window_s = window_s
        self._last = cpu_seconds(pid)
        self._since = time.monotonic()
        self.deadline = self._since + (self._FAR_S if self._last is not None else window_s)

    def check(self, pid: int) -> str | None:
        now_cpu = cpu_seconds(pid)
        now = time.monotonic()
        if now_cpu is None or self._last is None or now_cpu > self._last:
            self._last, self._since = now_cpu, now
            return None
        return "stalled" if now - self._since >= self._window_s else None


@dataclass(frozen=True)
class CompileOutcome:
    seconds: float  # the trial compile's wall time in the worker
    cpu_seconds: float  # its CPU time (all the worker's threads)
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

    def __init__(self, index: int, env: dict[str, str], zygote: Zygote | None) -> None:
        self.index = index
        self._env = env
        self._zygote = zygote
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.tokenizers: set[Hashable] = set()
        self.busy = False

    @property
    def started(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.tokenizers = set()
        self.kill()  # a dead predecessor's pipes (and, forked, its pidfd) are released
        if self._zygote is not None:
            try:
                self.proc = self._zygote.spawn(_START_TIMEOUT_S)
            except OSError as exc:
                logger.warning("compile zygote unavailable (%s); starting compile worker %d afresh", exc, self.index)
        if self.proc is None:
            # No preexec_fn: Python between fork and exec in a gRPC process can abort
            # (see parent_watch); the child arranges its own parent-death signal.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specmask.mask_service.server.compile_worker"],
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
                stream.close()  # type: ignore[union-attr]  # both pipes exist: started with stdin=stdout=PIPE

    def send(self, message: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        write_frame(self.proc.stdin, message)

    def _read(self, deadline: float, watch: Callable[[int], str | None] | None) -> Any:
        """Wait for one frame until ``deadline``; ``watch(pid)`` returning a reason aborts.
        Returns the message, "timeout", the watch's reason or None (the process died)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], min(_POLL_S, deadline - now))
            if ready:
                return read_frame(self.proc.stdout)
            reason = watch(self.proc.pid) if watch is not None else None
            if reason is not None:
                return reason


def _fail(job: _Job, error: BaseException) -> None:
    if job.future.set_running_or_notify_cancel():
        job.future.set_exception(error)


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
        wall_budget_s: float = 0.0,
        threads_per_compile: int = 1,
        nice: int = DEFAULT_WORKER_NICE,
        sched_idle: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._tokenizer_json = tokenizer_json
        self.budget_s = budget_s  # CPU seconds: past it, "too complex"
        self.wall_budget_s = wall_budget_s or default_wall_budget_s(budget_s)  # past it, "starved: retry"
        self.memory_cap_bytes = memory_cap_bytes
        self._max_queue = max_queue
        self._max_per_owner = max_queue_per_owner
        self._threads = threads_per_compile
        env = dict(os.environ)
        env[PARENT_PID_ENV] = str(os.getpid())
        env["SPECMASK_COMPILE_NICE"] = str(nice)
        env["SPECMASK_COMPILE_SCHED_IDLE"] = "1" if sched_idle else "0"
        # Kernel backstop at twice the polled cap (RSS polling acts first).
        env["SPECMASK_COMPILE_AS_EXTRA"] = str(2 * memory_cap_bytes if memory_cap_bytes else 0)
        # Workers are forked from one template process that has imported the engines
        # (compile_zygote): a restart after a killed compile costs milliseconds, not seconds.
        self._zygote = Zygote(env) if zygote_supported() else None
        self._workers = [_Worker(i, env, self._zygote) for i in range(workers)]
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
            mine = len(self._queue.get(owner, ()))
            others_waiting = len(self._queue) > (owner in self._queue)
            if mine >= self._max_per_owner and (others_waiting or self._queued >= self._max_queue):
                # Past its share an owner only borrows idle capacity: not while others wait.
                raise CompileQueueFull(
                    f"compile queue: {mine} grammars of this client already waiting "
                    f"(share {self._max_per_owner} while other clients wait); retry in ~{retry:.0f} s",
                    retry,
                )
            dropped = None
            if self._queued >= self._max_queue:
                dropped = self._drop_borrowed()  # an owner within its share displaces a borrower
                if dropped is None:
                    raise CompileQueueFull(
                        f"compile queue full ({self._queued} grammars waiting); retry in ~{retry:.0f} s", retry
                    )
            self._queue.setdefault(owner, deque()).append(job)
            self._queued += 1
            self._cond.notify_all()
        if dropped is not None:
            # Failed off this thread: the future's callbacks take locks our caller may hold.
            error = CompileQueueFull(
                f"compile queue: this client's grammar gave its borrowed place to another client's; "
                f"retry in ~{retry:.0f} s",
                retry,
            )
            threading.Thread(target=_fail, args=(dropped, error), name="compile-drop", daemon=True).start()
        return job.future

    def _drop_borrowed(self) -> _Job | None:
        """Take out the newest job of the owner furthest past its share (caller holds the lock)."""
        jobs = max(self._queue.values(), key=len, default=deque())
        if len(jobs) <= self._max_per_owner:
            return None
        job = jobs.pop()
        self._queued -= 1
        return job

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

    def _starved(self, what: str, cpu_used: float | None) -> CompileStarved:
        used = "" if cpu_used is None else f", {cpu_used:.1f} s of its {self.budget_s:g} s CPU budget used"
        return CompileStarved(
            f"compile {what} within the {self.wall_budget_s:g} s wall-clock backstop (the worker made no "
            f"progress{used}); "
            f"retry in ~{self.budget_s:.0f} s",
            retry_after_s=max(1.0, self.budget_s),
        )

    def _run(self, worker: _Worker, job: _Job) -> CompileOutcome:
        if not worker.started:
            worker.start()
        deadline = time.monotonic() + self.wall_budget_s
        if job.tok_key not in worker.tokenizers:
            worker.send(("tokenizer", job.tok_key, self._tokenizer_json(job.tok_key)))
            assert worker.proc is not None
            load = _StallWatch(worker.proc.pid, self.wall_budget_s)
            ack = worker._read(load.deadline, load.check)
            if ack != ("tokenizer-ok",):  # the box or the worker, not the grammar: not a verdict
                worker.kill()
                raise self._starved("worker did not load the tokenizer", None)
            worker.tokenizers.add(job.tok_key)
        worker.send(("compile", job.backend, job.tok_key, job.spec, self._threads))
        assert worker.proc is not None
        cpu_start = cpu_seconds(worker.proc.pid)
        stall = _StallWatch(worker.proc.pid, self.wall_budget_s)
        peak = 0
        cpu_used: float | None = None

        def within_limits(pid: int) -> str | None:
            nonlocal peak, cpu_used
            rss = rss_bytes(pid)
            peak = max(peak, rss)
            if self.memory_cap_bytes and rss > self.memory_cap_bytes:
                return "memory"
            now = cpu_seconds(pid)
            if cpu_start is not None and now is not None:
                cpu_used = now - cpu_start
                if cpu_used > self.budget_s:
                    return "cpu"
            return stall.check(pid)

        reply = worker._read(stall.deadline if cpu_start is not None else deadline, within_limits)
        too_complex = f"grammar too complex: compile exceeded {self.budget_s:g} s of CPU time"
        if isinstance(reply, tuple) and reply:
            if reply[0] == "ok":
                # The worker's own count: a compile that ended between two polls is judged alike.
                if float(reply[3]) > self.budget_s:
                    raise GrammarTooComplex(too_complex)
                return CompileOutcome(float(reply[1]), float(reply[3]), int(reply[2]), peak)
            if reply[0] == "refused":
                raise GrammarError(str(reply[1]))
            worker.kill()  # the worker may be in a bad state after a failure
            raise GrammarTooComplex(f"grammar too complex: compile failed ({reply[1]})")
        worker.kill()
        if reply == "cpu":
            raise GrammarTooComplex(too_complex)
        if reply == "memory":
            raise GrammarTooComplex(
                f"grammar too complex: compile exceeded the {self.memory_cap_bytes / 2**20:.0f} MiB memory cap"
            )
        if reply in ("timeout", "stalled"):
            raise self._starved("did not finish", cpu_used)
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
        if self._zygote is not None:
            self._zygote.stop()
