"""Hostile grammars: killable compiles within a CPU budget, a retryable wall-clock
backstop for starved compiles, cached refusals, a fair bounded queue that lends idle places.

Real xgrammar in real worker processes, real gRPC on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceClient, MaskServiceError
from specmask.mask_service.convert import grammar_to_proto
from specmask.mask_service.grammar.limits import GrammarLimits
from specmask.mask_service.server.compile_pool import DEFAULT_WORKER_NICE, CompilePool, CompileQueueFull
from specmask.mask_service.server.server import MaskServiceHandle, build_service
from specmask.mask_service.server.servicer import CLIENT_METADATA_KEY
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2_grpc as pb_grpc
from tests.mask_service.service_config import make_config

BUDGET_S = 2.0  # CPU seconds
WALL_S = 90.0  # the hostile fixture's wall backstop: the CPU budget must be what refuses
HUGE = GrammarSpec(
    GrammarKind.JSON_SCHEMA,
    json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}),
)
OPEN = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))


def _slow(i: int) -> GrammarSpec:
    """Distinct schemas that each take seconds to compile (thousands of optional properties)."""
    return GrammarSpec(
        GrammarKind.JSON_SCHEMA,
        json.dumps({"type": "object", "properties": {f"s{i}_{j}": {"type": "integer"} for j in range(6000)}}),
    )


@pytest.fixture(scope="module")
def hostile(bpe_dir, registry) -> Iterator[MaskServiceHandle]:
    # Limits raised, so the hostile schemas reach the compile workers and are time-boxed there.
    cfg = make_config(
        bpe_dir,
        compile_timeout_s=BUDGET_S,
        compile_wall_timeout_s=WALL_S,
        compile_workers=1,
        compile_queue=2,
        compile_queue_per_owner=1,
        grammar_limits=GrammarLimits(max_schema_bytes=10**7, max_properties=10**6),
        # Not the idle class: on a box shared with other test runs the worker must get
        # some CPU to reach its CPU budget (priority itself: test_workers_run_at_lowest_priority).
        compile_nice=10,
        compile_sched_idle=False,
    )
    handle = build_service(cfg, registry)
    handle.server.start()
    yield handle
    handle.stop(grace_s=0)


def _client(handle: MaskServiceHandle) -> MaskServiceClient:
    return MaskServiceClient(f"127.0.0.1:{handle.port}", deadline_s=30.0, max_retries=0)


def test_huge_schema_time_boxed_while_steady_requests_succeed(hostile, bpe_id) -> None:
    with _client(hostile) as c, _client(hostile) as steady:
        sid = steady.open_session(bpe_id, OPEN)
        latencies: list[float] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def steady_loop() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    steady.draft_masks([DraftMaskItem(sid, [])])
                    steady.session_count()
                except BaseException as exc:
                    errors.append(exc)
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.01)

        t = threading.Thread(target=steady_loop)
        t.start()
        try:
            t0 = time.monotonic()
            with pytest.raises(MaskServiceError) as info:
                c.validate_grammar(bpe_id, HUGE)
            took = time.monotonic() - t0
        finally:
            stop.set()
            t.join()
        assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.reason == "GRAMMAR_TOO_COMPLEX"
        # Judged on the worker's CPU time (unbounded, it ran ~11 minutes), not the wall clock.
        assert f"grammar too complex: compile exceeded {BUDGET_S:g} s of CPU time" in info.value.message
        assert took < WALL_S, took
        assert not errors, errors[:3]
        assert len(latencies) >= 10
        # the serving path kept answering during the compile (not blocked behind it)
        assert max(latencies) < 1.5, max(latencies)

        # The refusal is cached by grammar hash: no second compile.
        t0 = time.monotonic()
        with pytest.raises(MaskServiceError, match="too complex"):
            c.validate_grammar(bpe_id, HUGE)
        assert time.monotonic() - t0 < 1.0
        # A fresh worker took over: ordinary grammars still compile.
        c.validate_grammar(bpe_id, GrammarSpec(GrammarKind.REGEX, "[0-9]{1,4}"))
        steady.close_session(sid)


def test_compile_queue_is_bounded_and_fair(hostile, bpe_id) -> None:
    """One owner fills its share of the queue: its next grammar gets RESOURCE_EXHAUSTED with a
    retry hint, while another owner's grammar is still admitted and compiled."""
    results: dict[int, grpc.RpcError | None] = {}

    def send(i: int, owner: str, spec: GrammarSpec, *, wait_compiling: bool = False) -> None:
        """``wait_compiling``: retry "still compiling" as a client does (the grammar was admitted;
        on a busy box the flood's running compile can outlast the call's wait)."""
        request = pb.ValidateGrammarRequest(
            target=pb.GrammarTarget(tokenizer_id=bpe_id, grammar=grammar_to_proto(spec))
        )
        deadline = time.monotonic() + 300
        with grpc.insecure_channel(f"127.0.0.1:{hostile.port}") as channel:
            while True:
                try:  # metadata names the end client, as the orchestrator does
                    pb_grpc.MaskServiceStub(channel).ValidateGrammar(
                        request, metadata=((CLIENT_METADATA_KEY, owner),), timeout=60
                    )
                    results[i] = None
                    return
                except grpc.RpcError as exc:
                    results[i] = exc
                    compiling = exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "still compiling" in exc.details()
                    if not (wait_compiling and compiling) or time.monotonic() > deadline:
                        return
                time.sleep(1.0)

    threads = [threading.Thread(target=send, args=(i, "flooder", _slow(i))) for i in range(4)]
    for th in threads:
        th.start()
        time.sleep(0.3)  # in order: one runs, one waits, the rest find the owner's share full
    polite = GrammarSpec(GrammarKind.REGEX, "[a-f]{2,3}")
    other = threading.Thread(target=send, args=(99, "polite", polite), kwargs={"wait_compiling": True})
    other.start()
    for th in [*threads, other]:
        th.join(timeout=400)
    flood = [results[i] for i in range(4)]
    full = [e for e in flood if e is not None and e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert full, flood
    assert all("retry" in e.details() for e in full)
    assert all(("retry-after-ms" in dict(e.trailing_metadata() or ())) for e in full)
    assert results[99] is None, results[99]


def test_serving_process_skips_prechecks_the_trial_ran(hostile, bpe_id, monkeypatch) -> None:
    """The worker's trial compile ran the pre-checks (a pure-Python metaschema walk, most of a small
    schema's compile): the serving process, whose GIL draft-mask calls need, does not run them again."""
    from specmask.mask_service.grammar import grammar_checks

    calls: list[str] = []
    inner = grammar_checks._precheck

    def counting(spec: GrammarSpec) -> None:
        calls.append(spec.cache_key())
        inner(spec)

    monkeypatch.setattr(grammar_checks, "_precheck", counting)
    spec = GrammarSpec(
        GrammarKind.JSON_SCHEMA,
        json.dumps({"type": "object", "properties": {f"pre{j}": {"type": "integer"} for j in range(20)}}),
    )
    with _client(hostile) as c:
        resp = c.validate_grammar(bpe_id, spec)
    assert resp.compiled_bytes > 0
    assert calls == [], "the serving process re-ran the pre-checks of a grammar its compile worker accepted"


@pytest.fixture
def starving(bpe_dir, registry) -> Iterator[MaskServiceHandle]:
    """A replica whose CPU budget any grammar meets, with a short wall-clock backstop."""
    cfg = make_config(
        bpe_dir, compile_timeout_s=60.0, compile_wall_timeout_s=3.0, compile_nice=0, compile_sched_idle=False
    )
    handle = build_service(cfg, registry)
    handle.server.start()
    yield handle
    handle.stop(grace_s=0)


def test_starved_compile_is_retryable_and_not_cached(starving, bpe_id) -> None:
    """A compile that gets no CPU (its worker SIGSTOPped, as on a saturated box) is ended by the
    wall backstop: RESOURCE_EXHAUSTED with a retry hint, not "too complex", and not remembered."""
    cache = starving._parts[0]
    (pid,) = cache.pool.worker_pids()
    spec = GrammarSpec(GrammarKind.REGEX, "[0-9]{2,5}x")
    os.kill(pid, signal.SIGSTOP)
    try:
        with _client(starving) as c:
            t0 = time.monotonic()
            with pytest.raises(MaskServiceError) as info:
                c.validate_grammar(bpe_id, spec)
            took = time.monotonic() - t0
            assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
            assert info.value.reason == "COMPILE_STARVED"
            assert "wall-clock backstop" in info.value.message and "retry" in info.value.message
            assert "no progress" in info.value.message
            assert 3.0 <= took < 20.0, took
            assert cache.num_refusals == 0  # not a verdict on the grammar
            # A fresh worker took over and the same grammar compiles.
            assert c.validate_grammar(bpe_id, spec).compiled_bytes > 0
            assert c.session_count() == 0  # the replica kept serving
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_lone_owner_borrows_idle_queue_and_others_keep_their_share(registry, bpe_id) -> None:
    """With its worker stopped (nothing finishes), one owner's burst past its share is admitted into
    the idle queue; a second owner is still admitted within its share (a borrowed place is given up
    for it), and the borrower is no longer admitted past its share while the other waits."""
    size = registry.get(bpe_id).default_vocab_size
    pool = CompilePool(
        lambda key: str(registry.info(*key).serialize_json()),
        workers=1,
        budget_s=60.0,
        memory_cap_bytes=0,
        max_queue=3,
        max_queue_per_owner=1,
    )
    try:
        assert pool.wait_ready(120.0)
        (pid,) = pool.worker_pids()
        # Default priority: a modest nice, not the idle class (which a saturated box starves).
        assert os.getpriority(os.PRIO_PROCESS, pid) == DEFAULT_WORKER_NICE
        if hasattr(os, "SCHED_IDLE"):
            assert os.sched_getscheduler(pid) != os.SCHED_IDLE
        os.kill(pid, signal.SIGSTOP)

        def submit(owner: str, i: int):
            return pool.submit("xgrammar", (bpe_id, size), GrammarSpec(GrammarKind.REGEX, f"a{i}[0-9]+"), owner)

        running = submit("a", 0)
        deadline = time.monotonic() + 10
        while pool.running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.running == 1 and pool.queue_depth == 0
        burst = [submit("a", i) for i in (1, 2, 3)]  # share 1, two borrowed: the queue's 3 places
        assert pool.queue_depth == 3
        with pytest.raises(CompileQueueFull, match="share 1"):
            submit("a", 4)  # the queue is full
        other = submit("b", 0)  # within b's share: takes a's newest borrowed place
        assert pool.queue_depth == 3
        with pytest.raises(CompileQueueFull) as dropped:
            burst[-1].result(timeout=10)
        assert "borrowed place" in str(dropped.value) and dropped.value.retry_after_s >= 1.0
        assert not any(f.done() for f in [running, *burst[:2], other])
        with pytest.raises(CompileQueueFull, match="while other clients wait"):
            submit("a", 5)
    finally:
        pool.shutdown()  # kills the stopped worker too
