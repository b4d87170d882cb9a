"""Replica discovery: fixed addresses and dns:/// sets, and a router spreading sessions over
resolved addresses (the Kubernetes headless-Service case), with real DNS resolution of localhost."""

from __future__ import annotations

import json

import grpc
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceError
from specmask.mask_service.client.replicas import ReplicaSet, join_host_port, resolve_all, split_host_port
from specmask.mask_service.client.router import MaskRouter
from specmask.mask_service.server.server import build_service
from specmask.proto import health as health_names
from tests.mask_service.service_config import make_config

SCHEMA = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}}))


def test_split_host_port() -> None:
    assert split_host_port("mask:50061") == ("mask", 50061)
    assert split_host_port("[::1]:7") == ("::1", 7)
    for bad in ("mask", "mask:", ":1", "mask:0", "mask:70000", "mask:x"):
        with pytest.raises(ValueError):
            split_host_port(bad)


def test_join_host_port_brackets_ipv6() -> None:
    assert join_host_port("0.0.0.0", 5) == "0.0.0.0:5"
    assert join_host_port("::", 5) == "[::]:5"
    assert join_host_port("[::1]", 5) == "[::1]:5"
    assert split_host_port(join_host_port("::1", 7)) == ("::1", 7)


def test_server_binds_ipv6_any(bpe_dir, registry) -> None:
    """``--host ::`` (IPv6 / dual-stack clusters) binds and answers on ::1."""
    handle = build_service(make_config(bpe_dir, host="::"), registry)
    handle.server.start()
    try:
        assert handle.port > 0
        from specmask.orchestrator.dev.local_stack import health_status

        assert health_status(f"[::1]:{handle.port}", timeout_s=10.0) == 1
        # The liveness name the chart's startup/liveness probes ask (specmask/proto/health.py).
        assert health_status(f"[::1]:{handle.port}", service=health_names.LIVENESS, timeout_s=10.0) == 1
    finally:
        handle.stop(grace_s=0)


def test_replica_set_static_and_dns() -> None:
    rs = ReplicaSet(["10.0.0.9:1", "dns:///localhost:5", "127.0.0.1:5"])
    addresses = rs.addresses()
    assert addresses[:2] == ["10.0.0.9:1", "127.0.0.1:5"]  # static first, then resolved
    assert len(addresses) == len(set(addresses))  # 127.0.0.1:5 from DNS is not listed twice
    assert set(resolve_all("localhost", 5)) <= set(addresses)
    assert rs.has_dns
    rs.refresh()  # a failure-triggered lookup runs on the background thread
    assert set(resolve_all("localhost", 5)) <= set(rs.addresses())
    rs.close()
    assert rs._thread is not None
    rs._thread.join(5)
    assert not rs._thread.is_alive()
    for bad in (["dns://8.8.8.8/mask:1"], ["dns:///mask"], ["mask"], []):
        with pytest.raises(ValueError):
            ReplicaSet(bad)


def test_router_over_a_dns_target(bpe_dir, registry, bpe_id) -> None:
    """dns:///localhost:P1 plus 127.0.0.1:P2: sessions land on both servers, masks agree, and
    release_owner reaches both. (Where localhost also resolves to ::1, nothing listens there:
    the router fails over, as it would for a pod that just left.)"""
    if not any(a.startswith("127.0.0.1:") for a in resolve_all("localhost", 1)):
        pytest.skip("localhost does not resolve to 127.0.0.1 here (the test servers listen there)")
    handles = [build_service(make_config(bpe_dir), registry) for _ in range(2)]
    for h in handles:
        h.server.start()
    router = MaskRouter([f"dns:///localhost:{handles[0].port}", f"127.0.0.1:{handles[1].port}"], owner="w")
    try:
        sids = []
        while min(len(h.sessions) for h in handles) == 0:
            assert len(sids) < 64, [len(h.sessions) for h in handles]
            sids.append(router.open_session(bpe_id, SCHEMA))
        results = router.draft_masks([DraftMaskItem(s, []) for s in sids])
        first = results[0].bitmask.numpy()
        for r in results:
            assert (r.bitmask.numpy() == first).all()
        assert router.release_owner() == len(sids)
        assert sum(len(h.sessions) for h in handles) == 0
    finally:
        router.close()
        for h in handles:
            h.stop(grace_s=0)


def test_a_replica_dns_answers_after_the_last_lookup_is_tried_before_giving_up(
    monkeypatch, bpe_dir, registry, bpe_id
) -> None:
    """The router last looked the name up while it named only one pod, and that pod died; the name
    now answers another pod, which the 10 s periodic lookup has not seen yet. Both the grammar
    check and a session open look the name up again at once, instead of failing the call with
    "no mask-service replica reachable". (The lookup is replaced: no DNS server to change here.)"""
    import socket

    import specmask.mask_service.client.replicas as replicas

    with socket.socket() as s:  # a port nothing listens on: the dead pod
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    live = build_service(make_config(bpe_dir), registry)
    live.server.start()
    answers = [[dead]]
    monkeypatch.setattr(replicas, "resolve_all", lambda host, port: list(answers[-1]))
    routers = [MaskRouter(["dns:///mask-headless:50061"], owner=f"w{i}", deadline_s=5.0) for i in range(2)]
    try:
        assert all(r._replicas.addresses() == [dead] for r in routers)
        answers.append([f"127.0.0.1:{live.port}"])  # the endpoints changed; no router has looked since
        assert routers[0].validate_grammar(bpe_id, SCHEMA).enforcement == "exact"
        sid = routers[1].open_session(bpe_id, SCHEMA)
        assert len(live.sessions) == 1
        assert routers[1].draft_masks([DraftMaskItem(sid, [])])[0].bitmask.numpy().any()
        # The name answers only the dead pod: the lookup adds nothing, and the call fails, typed.
        answers.append([dead])
        routers.append(MaskRouter(["dns:///mask-headless:50061"], deadline_s=2.0))
        with pytest.raises(MaskServiceError, match="no mask-service replica reachable") as err:
            routers[-1].validate_grammar(bpe_id, SCHEMA)
        assert err.value.code is grpc.StatusCode.UNAVAILABLE
    finally:
        for r in routers:
            r.close()
        live.stop(grace_s=0)
