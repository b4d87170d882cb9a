"""A template process that compile workers are forked from, so a worker starts in milliseconds.

A compile worker's start is mostly imports: xgrammar (which imports torch) and
jsonschema's format checkers, seconds of CPU per start. A worker is started
again after every compile it was killed for (over its CPU budget or memory cap,
stalled), so a client sending too-complex grammars made the service pay that
start again and again, and each worker held its own copy of those modules.

The pool (mask_service.compile_pool) starts this process once, the way it used
to start a worker (no ``preexec_fn``: the service is full of gRPC threads, see
parent_watch), and the zygote imports the engines once, single-threaded, with
the workers' priority. To start a worker the pool sends one end of a fresh
socket pair over a Unix socket; the zygote forks, and the child serves compile
jobs on that socket exactly as a spawned worker serves them on its pipes
(``compile_worker.serve``). The zygote answers with the child's pid and a pidfd
for it, which the pool signals and waits on (``ForkedProcess``) as it would a
``Popen``: the child is the zygote's, not the pool's, so a pidfd is what stays
tied to that process whatever happens to its pid. The zygote reaps its children
itself (SIGCHLD ignored).

In ``ps`` a worker shows the zygote's command line (a fork runs no new program).
The replica's memory guard counts each worker's RSS, which includes the pages it
shares with the zygote, so the zygote itself (the same pages) is left out of it.

Lifetimes: the zygote exits when the pool closes its socket (a service that
stops or dies, the kernel closes it), and every worker dies with the zygote
(parent-death signal), so nothing outlives the service. Linux only (pidfds);
elsewhere, or if the zygote cannot start, the pool spawns workers as before.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import IO, cast

from specmask.common.parent_watch import PARENT_PID_ENV

# The fd number of the zygote's end of its control socket, in the zygote's environment.
_SOCKET_FD_ENV = "SPECMASK_ZYGOTE_FD"
_PID = struct.Struct("<q")
# How long a zygote that has answered before may take to fork a worker: a fork takes
# milliseconds, so one that does not answer is stopped or wedged, and the pool spawns the
# worker itself rather than wait out the first start's import allowance.
_FORK_ANSWER_S = 10.0


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


class ForkedProcess:
    """A compile worker forked by the zygote, with the part of ``subprocess.Popen`` the pool uses."""

    def __init__(self, pid: int, pidfd: int, conn: socket.socket) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._conn = conn
        self.stdin: IO[bytes] = conn.makefile("wb")
        self.stdout: IO[bytes] = conn.makefile("rb")
        # Not the child's: the zygote reaps it, so its exit status is not ours to read.
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._pidfd >= 0 and select.select([self._pidfd], [], [], 0)[0]:
            self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            if not select.select([self._pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"compile worker {self.pid}", timeout or 0.0)
            self.returncode = -1
        self._release()
        return -1

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _release(self) -> None:
        for stream in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        self._conn.close()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


class Zygote:
    """The pool's side: starts the zygote process and asks it for workers (thread-safe)."""

    def __init__(self, env: dict[str, str]) -> None:
        self._env = env
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._answered = False  # the running zygote has forked a worker (its imports are done)

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(self._env)
        env[_SOCKET_FD_ENV] = str(theirs.fileno())
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "specmask.mask_service.server.compile_zygote"],
                env=env,
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self._sock = ours
        return ours

    def spawn(self, timeout_s: float) -> ForkedProcess:
        """A new worker, forked from the zygote (started first if it is not running). Raises
        OSError when the zygote cannot answer: the caller then spawns the worker itself."""
        with self._lock:
            sock = self._sock if self._proc is not None and self._proc.poll() is None else None
            if sock is None:
                self._stop_locked()
                sock = self._start()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                socket.send_fds(sock, [b"w"], [theirs.fileno()])
                theirs.close()
                # The first answer waits for the zygote's imports.
                sock.settimeout(min(timeout_s, _FORK_ANSWER_S) if self._answered else timeout_s)
                data, fds, _, _ = socket.recv_fds(sock, _PID.size, 1)
            except OSError:
                ours.close()
                theirs.close()
                self._stop_locked()
                raise
            if len(data) < _PID.size or len(fds) != 1:
                ours.close()
                for fd in fds:
                    os.close(fd)
                self._stop_locked()
                raise OSError("the compile zygote did not answer")
            (pid,) = _PID.unpack(data)
            self._answered = True
            return ForkedProcess(pid, fds[0], ours)

    def stop(self) -> None:
        with self._lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        sock, self._sock = self._sock, None
        proc, self._proc = self._proc, None
        self._answered = False
        if sock is not None:
            sock.close()  # the zygote exits at end of stream
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _serve_forked(conn_fd: int) -> None:
    """In a forked child: serve compile jobs on ``conn_fd`` (never returns)."""
    from specmask.mask_service.server import compile_worker

    code = 0
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        with socket.socket(fileno=conn_fd) as conn:
            stdin = cast(IO[bytes], conn.makefile("rb"))
            stdout = cast(IO[bytes], conn.makefile("wb"))
            compile_worker.serve_frames(stdin, stdout)
    except BaseException:  # a child of the zygote must never return into its loop
        code = 1
    finally:
        os._exit(code)


def main() -> int:
    from specmask.common.parent_watch import die_with_parent_from_env
    from specmask.mask_service.server import compile_worker

    compile_worker.prepare_process()
    control = socket.socket(fileno=int(os.environ.pop(_SOCKET_FD_ENV)))
    compile_worker.preload()
    # Workers check their parent-death signal against their real parent: this process.
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(control, 16, 1)
        except OSError:
            return 0
        if not data:
            return 0  # the pool closed its end: the service is stopping or gone
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            control.close()
            die_with_parent_from_env()
            _serve_forked(fds[0])
        os.close(fds[0])
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            control.sendall(_PID.pack(-1))  # no fd: the pool treats the worker as not started
            continue
        try:
            socket.send_fds(control, [_PID.pack(pid)], [pidfd])
        finally:
            os.close(pidfd)


if __name__ == "__main__":
    raise SystemExit(main())
