"""The compile-worker process: compiles one grammar at a time for its parent (mask_service.compile_pool).

Why a process: a grammar engine's compile cannot be cancelled, and a hostile
schema can run for minutes and take gigabytes. In a child it can be
killed at its time budget or memory cap without touching the serving process,
whose draft-mask calls, commits and health keep their latency.

The child is a *trial*: it reports whether the grammar compiles within budget
(and how long it took, and the compiled size), and the parent then compiles the
accepted grammar itself. A compiled grammar could be shipped back instead
(xgrammar 0.2.8 has ``CompiledGrammar.serialize_json``), but on xgrammar
0.2.8 serialising and parsing back each cost several compiles and the JSON is
large, so compiling twice is the cheaper way to get a proven grammar into the
parent. It also keeps the worker backend-agnostic: it needs nothing from a
backend but ``make_compiler`` and ``compile``.

Wire protocol on stdin/stdout (a socket, for a worker forked by
compile_zygote): frames of an 8-byte little-endian length and a pickle (parent
and child are the same code, so pickle is safe here: nothing outside the service
writes to these pipes). Messages:

* child -> parent, once: ``("ready", pid)``
* parent -> child: ``("tokenizer", tok_key, tokenizer_info_json)`` (once per key)
* child -> parent: ``("tokenizer-ok",)`` (loading it is not charged to a compile's CPU budget)
* parent -> child: ``("compile", backend_name, tok_key, spec, max_threads)``
* child -> parent: ``("ok", seconds, compiled_bytes, cpu_seconds)`` or
  ``("refused", message)`` (the engine rejected the grammar: the message is the
  client's) or ``("failed", message)`` (anything else, e.g. out of memory under the cap)

Priority: the worker lowers itself before importing anything (so every thread
the engine starts inherits it): nice ``SPECMASK_COMPILE_NICE`` (default 5) and,
only on Linux with ``SPECMASK_COMPILE_SCHED_IDLE=1`` (an operator's opt-in), the
SCHED_IDLE policy. A plain nice keeps the serving process ahead while the
kernel still guarantees the worker a share of the CPU beside any number of
runnable processes; the idle class would get none on a saturated box, and no
schema would compile there. The verdict "too complex" is taken on the worker's
own CPU time (compile_pool), not on the wall clock, so a slowed compile is not
mistaken for an expensive one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import resource
import struct
import sys
import time
from typing import IO, Any

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")


def write_frame(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> Any:
    """The next message, or None at end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def _cap_address_space(extra_bytes: int) -> None:
    """A hard backstop under the parent's RSS polling: the kernel refuses allocations
    beyond what the process has mapped now plus ``extra_bytes`` (0 = no cap)."""
    if extra_bytes <= 0:
        return
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + extra_bytes
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def preload() -> None:
    """The imports a worker needs before its first job (compile_zygote forks workers after them)."""
    import xgrammar  # noqa: F401  # imports torch: most of a worker's start

    from specmask.mask_service.grammar.backends import BACKENDS  # noqa: F401
    from specmask.mask_service.grammar.schema_check import verifiable_formats

    # jsonschema with its format checkers (the prechecks use them) costs seconds of CPU on its
    # first import (the RFC 3987 parser is built then): paid here, before "ready", never by the
    # first job's CPU budget.
    assert verifiable_formats()


def serve(stdin: IO[bytes], stdout: IO[bytes], *, address_space_extra: int) -> None:
    preload()
    import xgrammar as xgr

    from specmask.mask_service.errors import GrammarError
    from specmask.mask_service.grammar.backends import BACKENDS

    # Threads xgrammar starts later (and their malloc arenas) map more address
    # space, so the cap is taken once the heavy imports are done.
    _cap_address_space(address_space_extra)
    infos: dict[Any, Any] = {}
    compilers: dict[tuple[str, Any, int], Any] = {}
    write_frame(stdout, ("ready", os.getpid()))
    while True:
        msg = read_frame(stdin)
        if msg is None:
            return
        if msg[0] == "tokenizer":
            _, tok_key, info_json = msg
            infos[tok_key] = xgr.TokenizerInfo.deserialize_json(info_json)
            write_frame(stdout, ("tokenizer-ok",))
            continue
        _, backend_name, tok_key, spec, max_threads = msg
        t0 = time.perf_counter()
        cpu0 = time.process_time()  # all threads of this process: the engine's pool included
        try:
            backend = BACKENDS[backend_name]
            ckey = (backend_name, tok_key, max_threads)
            if ckey not in compilers:
                compilers[ckey] = backend.make_compiler(infos[tok_key], max_threads)
            compiled = backend.compile(compilers[ckey], spec)
            size = int(getattr(compiled, "memory_size_bytes", 0))
            reply: tuple[Any, ...] = ("ok", time.perf_counter() - t0, size, time.process_time() - cpu0)
            del compiled
        except GrammarError as exc:
            reply = ("refused", exc.message)
        except MemoryError:
            reply = ("failed", "out of memory under the compile worker's cap")
        except Exception as exc:
            reply = ("failed", f"{type(exc).__name__}: {exc}")
        write_frame(stdout, reply)


def lower_priority(nice: int, sched_idle: bool) -> None:
    """Yield the CPU to the serving process (draft masks, commits): this thread and every
    thread started after it (Linux keeps nice and policy per thread, and threads inherit them)."""
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
    if sched_idle and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def prepare_process() -> None:
    """First thing in a compile-worker process, spawned or the zygote workers are forked from
    (compile_zygote): exit with the parent, lower the priority (threads and forks started later
    inherit it), log warnings to stderr."""
    from specmask.common.parent_watch import die_with_parent_from_env

    die_with_parent_from_env()
    lower_priority(
        int(os.environ.get("SPECMASK_COMPILE_NICE", "5")), os.environ.get("SPECMASK_COMPILE_SCHED_IDLE") == "1"
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def serve_frames(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """``serve`` under the address-space headroom the pool put in the environment. Frames go
    over ``stdout`` only: fd 1 becomes stderr, so anything a library prints goes there."""
    extra = int(os.environ.get("SPECMASK_COMPILE_AS_EXTRA", "0"))
    os.dup2(2, 1)
    serve(stdin, stdout, address_space_extra=extra)


def main() -> int:
    prepare_process()
    serve_frames(sys.stdin.buffer, os.fdopen(os.dup(1), "wb"))  # the real stdout, kept for frames
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
