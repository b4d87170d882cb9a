"""Compile workers forked from the zygote: a restart after a killed compile is cheap, and nothing
outlives the pool (real xgrammar, real processes)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.errors import GrammarTooComplex
from specmask.mask_service.server.compile_pool import CompileOutcome, CompilePool, cpu_seconds
from specmask.mask_service.server.compile_zygote import supported

pytestmark = pytest.mark.skipif(not supported(), reason="the compile zygote needs Linux pidfds")

HUGE = GrammarSpec(
    GrammarKind.JSON_SCHEMA,
    json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}),
)
SMALL = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))


@pytest.fixture
def pool(bpe_dir: Path) -> Iterator[CompilePool]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    info = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json")), stop_token_ids=[0]
    )
    info_json = info.serialize_json()
    p = CompilePool(
        lambda _key: info_json, workers=1, budget_s=0.5, memory_cap_bytes=0, max_queue=4, max_queue_per_owner=4
    )
    assert p.wait_ready(300.0)
    yield p
    p.shutdown()


def _compile(pool: CompilePool, spec: GrammarSpec) -> CompileOutcome:
    return pool.submit("xgrammar", "bpe", spec).result(timeout=300.0)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _zygote_pid(pool: Any) -> int:
    proc = pool._zygote._proc
    assert proc is not None
    return int(proc.pid)


def test_a_worker_killed_for_its_budget_is_replaced_by_a_cheap_fork(pool: CompilePool) -> None:
    (first,) = pool.worker_pids()
    zygote = _zygote_pid(pool)
    assert _ppid(first) == zygote  # forked, not spawned by the pool
    for _ in range(2):
        with pytest.raises(GrammarTooComplex):
            _compile(pool, HUGE)
        assert _compile(pool, SMALL).compiled_bytes > 0
        (worker,) = pool.worker_pids()
        assert worker != first and _ppid(worker) == zygote
        # A worker spawned afresh pays seconds of CPU importing xgrammar (and torch) before its
        # first job; a fork of the zygote inherits them.
        used = cpu_seconds(worker)
        assert used is not None and used < 1.0, used
        assert not _alive(first)
        first = worker


def test_a_dead_zygote_takes_its_workers_and_is_started_again(pool: CompilePool) -> None:
    (worker,) = pool.worker_pids()
    zygote = _zygote_pid(pool)
    os.kill(zygote, signal.SIGKILL)
    assert _gone_within([worker], 30.0), "a worker outlived its zygote"
    # The pool notices the dead worker at its next job and forks one from a new zygote.
    assert _compile(pool, SMALL).compiled_bytes > 0
    (again,) = pool.worker_pids()
    assert _zygote_pid(pool) != zygote and _ppid(again) == _zygote_pid(pool)


def test_shutdown_leaves_no_process_behind(pool: CompilePool) -> None:
    assert _compile(pool, SMALL).compiled_bytes > 0
    pids = [*pool.worker_pids(), _zygote_pid(pool)]
    pool.shutdown()
    assert _gone_within(pids, 30.0), [p for p in pids if _alive(p)]


def test_a_stopped_zygote_does_not_hold_up_compiles(pool: CompilePool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zygote that stops answering (SIGSTOP) costs the pool a short wait, then the worker is
    spawned the old way and the compile is served; the stopped zygote is replaced."""
    import specmask.mask_service.server.compile_zygote as zygote_module

    monkeypatch.setattr(zygote_module, "_FORK_ANSWER_S", 2.0)
    zygote = _zygote_pid(pool)
    os.kill(zygote, signal.SIGSTOP)
    try:
        with pytest.raises(GrammarTooComplex):
            _compile(pool, HUGE)  # its worker is killed: the next compile needs a new one
        t0 = time.monotonic()
        assert _compile(pool, SMALL).compiled_bytes > 0
        # Well inside the first start's import allowance (120 s), which a stopped zygote used
        # to hold every restart for.
        assert time.monotonic() - t0 < 60.0
        (worker,) = pool.worker_pids()
        assert _ppid(worker) == os.getpid()  # spawned by the pool itself
        assert _gone_within([zygote], 30.0), "the stopped zygote was left behind"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(zygote, signal.SIGCONT)
