"""Failure handling: a mask-service replica dies mid-generation; overload; worker-reported errors."""

from __future__ import annotations

import json
import time

import grpc
import jsonschema
import pytest

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.orchestrator.dev.local_stack import health_status
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import (
    LONG_MAX_TOKENS,
    LONG_SCHEMA,
    MAX_BATCH,
    MAX_QUEUE,
    PROMPT,
    ThreadStack,
    stream_concurrently,
)

pytestmark = pytest.mark.slow

SERVING = 1  # grpc.health.v1 HealthCheckResponse.SERVING
NOT_SERVING = 2


def _wait_health(address: str, want: int, timeout_s: float = 30.0) -> None:
    """Readiness is probed on a timer (orchestrator.readiness): wait for it to say ``want``."""
    deadline = time.monotonic() + timeout_s
    while (status := health_status(address)) != want:
        assert time.monotonic() < deadline, f"health stayed {status}, expected {want}"
        time.sleep(0.2)


def test_replica_killed_mid_generation(stack: ThreadStack) -> None:
    """Every in-flight request completes with valid output after SIGKILL of one of two replicas."""
    assert stack.running is not None
    replicas = stack.running.mask_services
    assert len(replicas) == 2
    stack.wait_idle()
    requests = [
        build_request(
            PROMPT,
            schema=LONG_SCHEMA,
            temperature=1.0,
            seed=100 + i,
            max_tokens=LONG_MAX_TOKENS,
            speculation=i % 2 == 0,
        )
        for i in range(8)
    ]
    victim = replicas[0]
    try:
        # Kill once every request is mid-generation, sessions spread over both replicas.
        results = stream_concurrently(stack.address, requests, on_started=victim.kill)
        for r in results:
            assert r.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE, (r.finish_reason, r.error)
            jsonschema.validate(json.loads(r.text), LONG_SCHEMA)
        active, _ = stack.wait_idle()
        assert active == [0, 0]
    finally:
        # Same port again: routers reach it once its cool-down ends.
        victim.start()
    assert health_status(stack.address) == SERVING


def test_overload_is_refused_with_resource_exhausted(stack: ThreadStack) -> None:
    stack.wait_idle()
    capacity = 2 * MAX_BATCH + MAX_QUEUE
    n = capacity + 40
    with OrchestratorClient(stack.address) as client:
        # The replica test_replica_killed_mid_generation restarted comes back with an empty
        # grammar cache: the burst below then validates a schema that is compiling. The
        # orchestrator sends one ValidateGrammar per (schema, client) in flight
        # (specmask/orchestrator/single_flight.py), so the burst costs the replica one compile waiter;
        # before, its requests past 12 got RESOURCE_EXHAUSTED "busy compiling" (this test was
        # flaky then), which this test must not count as admission refusing them.
        futures = [
            client.stub.Generate.future(
                build_request(
                    PROMPT, schema=LONG_SCHEMA, temperature=1.0, seed=i, max_tokens=LONG_MAX_TOKENS, speculation=False
                ),
                timeout=300,
            )
            for i in range(n)
        ]
        codes = []
        for f in futures:
            try:
                resp = f.result()
                assert resp.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE, resp.error
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
    exhausted = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert exhausted >= 1, "a burst past batch + queue capacity must be refused, not queued without bound"
    assert codes.count(grpc.StatusCode.OK) >= 2 * MAX_BATCH
    stack.wait_idle()
    assert health_status(stack.address) == SERVING


def test_mask_service_down_fails_only_constrained_requests(stack: ThreadStack) -> None:
    """All replicas die mid-generation: grammar requests finish with ERROR (the worker reports it
    per sequence), unconstrained neighbours in the same batch finish normally, readiness turns
    NOT_SERVING (it used to stay SERVING while every grammar request failed), and once a
    replica is back readiness returns and grammar requests work again."""
    assert stack.running is not None
    replicas = stack.running.mask_services
    stack.wait_idle()
    requests = [
        build_request(
            PROMPT,
            schema=LONG_SCHEMA if i % 2 == 0 else None,  # constrained and unconstrained neighbours
            temperature=1.0,
            seed=200 + i,
            max_tokens=LONG_MAX_TOKENS,
            speculation=False,
        )
        for i in range(6)
    ]

    def kill_all() -> None:
        for r in replicas:
            r.kill()

    try:
        results = stream_concurrently(stack.address, requests, on_started=kill_all)
        for i, r in enumerate(results):
            if i % 2 == 0:
                assert r.finish_reason == pb.FINISH_REASON_ERROR and r.error, (i, r.finish_reason)
            else:
                assert r.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), (i, r.error)
        _wait_health(stack.address, NOT_SERVING)
        # LONG_SCHEMA's acceptance is kept (specmask/orchestrator/verdict_cache.py) but not trusted while
        # no replica answers: a new request for it still fails fast at admission.
        with OrchestratorClient(stack.address) as client, pytest.raises(grpc.RpcError) as down:
            client.generate(build_request(PROMPT, schema=LONG_SCHEMA, temperature=0.0, max_tokens=4))
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE, down.value
    finally:
        for r in replicas:
            r.start(wait=False)
        for r in replicas:
            r.wait_serving()
    _wait_health(stack.address, SERVING)
    active, _ = stack.wait_idle()
    assert active == [0, 0]
    stack.assert_replicas_serving()
    # Routers retry a dead replica after a short cool-down; then grammars work again.
    deadline = time.monotonic() + 60
    while True:
        with OrchestratorClient(stack.address) as client:
            try:
                resp = client.generate(
                    build_request(PROMPT, schema=LONG_SCHEMA, temperature=0.0, max_tokens=LONG_MAX_TOKENS)
                )
            except grpc.RpcError as exc:
                resp = None
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        if resp is not None and resp.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE:
            break
        assert time.monotonic() < deadline, "grammar requests did not recover after the replicas came back"
        time.sleep(1.0)


def test_health_and_reflection(stack: ThreadStack) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    assert health_status(stack.address) == SERVING
    assert health_status(stack.address, service="specmask.orchestrator.v1.OrchestratorService") == SERVING
    with grpc.insecure_channel(stack.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = list(
            stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        )
    names = {s.name for s in responses[0].list_services_response.service}
    assert "specmask.orchestrator.v1.OrchestratorService" in names
    assert "grpc.health.v1.Health" in names


def test_metrics_endpoint(stack: ThreadStack) -> None:
    import urllib.request

    assert stack.running is not None
    registry = stack.running.server.metrics.registry

    def session_waits() -> float:
        return sum(
            registry.get_sample_value("specmask_session_waits_total", {"outcome": o}) or 0.0
            for o in ("ready", "joined_late", "sat_out")
        )

    def phase_sums() -> dict[str, tuple[float, float]]:
        return {
            name: (
                registry.get_sample_value(f"specmask_{name}_seconds_sum") or 0.0,
                registry.get_sample_value(f"specmask_{name}_seconds_count") or 0.0,
            )
            for name in ("request_admission", "request_queue", "time_to_first_token")
        }

    waits_before, phases_before = session_waits(), phase_sums()
    with OrchestratorClient(stack.address) as client:
        client.generate(build_request(PROMPT, schema=LONG_SCHEMA, temperature=0.0, max_tokens=LONG_MAX_TOKENS))
    assert session_waits() == waits_before + 1  # one grammar sequence: its first step reported once
    # One request: one observation per phase, and admission + queue are parts of its time to first token.
    took = {
        name: (after[0] - phases_before[name][0], after[1] - phases_before[name][1])
        for name, after in phase_sums().items()
    }
    assert all(count == 1.0 for _, count in took.values()), took
    assert took["request_admission"][0] + took["request_queue"][0] <= took["time_to_first_token"][0], took
    port = stack.running.server.metrics_port
    assert port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for name in (
        'specmask_requests_total{finish_reason="grammar_complete"}',
        "specmask_request_latency_seconds_count",
        "specmask_time_to_first_token_seconds_count",
        "specmask_request_admission_seconds_count",
        "specmask_request_queue_seconds_count",
        "specmask_request_tokens_per_second_count",
        "specmask_generated_tokens_total",
        "specmask_target_forwards_total",
        "specmask_drafts_proposed_total",
        "specmask_drafts_accepted_total",
        "specmask_mask_wait_seconds_count",
        "specmask_session_waits_total",
        "specmask_steps_sat_out_total",
        "specmask_worker_step_seconds_count",
        "specmask_queue_depth",
        "specmask_healthy_workers 2.0",
    ):
        assert name in body, name
    # Counters, not lifetime-ratio gauges (ratios come from rate() over any window).
    assert "specmask_acceptance_rate" not in body and "specmask_tokens_per_target_forward" not in body
