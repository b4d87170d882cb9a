"""One grammar check per (schema, client) in flight (specmask/orchestrator/single_flight.py).

A burst of requests with one schema the replica has not compiled yet must cost the
replica one compile waiter, not one per request: the replica bounds waiters per
client (each holds one of its gRPC threads) and refused the rest of such a burst
with RESOURCE_EXHAUSTED "busy compiling". Real mask service, real compile worker,
real gRPC on 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.mask_service.server.server import MaskServiceHandle, build_service
from specmask.orchestrator.errors import InvalidRequest
from specmask.orchestrator.grammar_check import MaskServiceGrammarChecker
from specmask.orchestrator.single_flight import SingleFlight
from tests.mask_service.service_config import make_config

BURST = 24


def test_followers_share_the_leaders_result_and_exception() -> None:
    flights: SingleFlight[int] = SingleFlight()
    started, release = threading.Event(), threading.Event()
    calls = []

    def slow() -> int:
        calls.append(1)
        started.set()
        release.wait(10)
        return 7

    results: list[int] = []
    leader = threading.Thread(target=lambda: results.append(flights.run("k", slow)))
    leader.start()
    assert started.wait(10)
    followers = [threading.Thread(target=lambda: results.append(flights.run("k", slow))) for _ in range(5)]
    for th in followers:
        th.start()
    other = flights.run("other key", lambda: 3)  # another key never waits on this one
    deadline = time.monotonic() + 5
    while flights.in_flight() != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # let the followers reach their wait (one arriving after the release would run slow() again)
    release.set()
    for th in [leader, *followers]:
        th.join(10)
    assert other == 3
    assert results == [7] * 6 and len(calls) == 1
    assert flights.in_flight() == 0
    assert flights.run("k", lambda: 8) == 8  # nothing cached past the call

    def boom() -> int:
        raise InvalidRequest("bad grammar", reason="GRAMMAR_INVALID", field="grammar")

    with pytest.raises(InvalidRequest, match="bad grammar"):
        flights.run("k", boom)
    assert flights.in_flight() == 0


@pytest.fixture(scope="module")
def service(bpe_dir) -> Iterator[MaskServiceHandle]:
    # Two compile waiters, one of them reserved for other clients: without single flight
    # a client's second concurrent request for a schema still compiling is refused.
    handle = build_service(make_config(bpe_dir, compile_waiters=2, compile_queue_per_owner=1))
    handle.server.start()
    yield handle
    handle.stop(grace_s=0)


def test_a_burst_with_one_new_schema_costs_one_compile_waiter(service, bpe_dir, bpe_tokenizer) -> None:
    checker = MaskServiceGrammarChecker(
        (f"127.0.0.1:{service.port}",),
        tokenizer_id=tokenizer_id_for_path(bpe_dir),
        vocab_size=bpe_tokenizer.get_vocab_size(),
        deadline_s=120.0,
        max_retries=0,
    )
    # Compiles for a few hundred ms at least (trial in the worker process, then in the
    # service), so the whole burst arrives while it runs.
    props = {f"p{j}": {"type": "integer"} for j in range(200)}
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": props}))
    gate = threading.Barrier(BURST)
    outcomes: list[BaseException | str] = []

    def send() -> None:
        gate.wait(30)
        try:
            outcomes.append(checker.check(spec, client="client:burst").backend)
        except Exception as exc:  # collected and asserted below
            outcomes.append(exc)

    threads = [threading.Thread(target=send) for _ in range(BURST)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    finally:
        checker.close()
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(outcomes) == BURST and not errors, errors  # before: Overloaded ("busy compiling") past the first
    assert set(outcomes) == {"xgrammar"}
