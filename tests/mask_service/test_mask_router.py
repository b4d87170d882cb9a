"""MaskRouter over two real servers: placement, failover with replay, lost-session recovery, error ids."""

from __future__ import annotations

import json
import time

import grpc
import numpy as np
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceClient, MaskServiceError
from specmask.mask_service.client.router import MaskRouter
from specmask.mask_service.server.server import build_service
from tests.mask_service.service_config import make_config

SCHEMA = GrammarSpec(
    GrammarKind.JSON_SCHEMA,
    json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["name", "n"],
        }
    ),
)
DOC = '{"name":"alpha beta","n":1234}'


def _expected(address: str, bpe_id: str, toks: list[int], p: int) -> np.ndarray:
    with MaskServiceClient(address) as c:
        sid = c.open_session(bpe_id, SCHEMA)
        return (
            c.draft_masks([DraftMaskItem(sid, toks[p : p + 3], commit_tokens=toks[:p], commit_seq=1)])[0]
            .bitmask.numpy()
            .copy()
        )


def _open_spread(router: MaskRouter, bpe_id: str, n: int) -> list[str]:
    """At least ``n`` sessions, more if needed until every replica holds one: placement hashes
    random session ids, so a fixed n lands on one replica now and then (1 in 2^(n-1) for 2)."""
    sids = [router.open_session(bpe_id, SCHEMA) for _ in range(n)]
    while len({router._sessions[s].address for s in sids}) < len(router._replicas.addresses()):
        assert len(sids) < 64, "placement never reached every replica"
        sids.append(router.open_session(bpe_id, SCHEMA))
    return sids


def test_router_failover_and_replay(bpe_dir, registry, bpe_id, hf_tok) -> None:
    toks = hf_tok.encode(DOC, add_special_tokens=False)
    handles = [build_service(make_config(bpe_dir), registry) for _ in range(2)]
    for h in handles:
        h.server.start()
    addresses = [f"127.0.0.1:{h.port}" for h in handles]
    router = MaskRouter(addresses, deadline_s=5.0, max_retries=0)
    try:
        router.validate_grammar(bpe_id, SCHEMA)
        sids = _open_spread(router, bpe_id, 8)
        counts = [len(h.sessions) for h in handles]
        assert sum(counts) == len(sids) and min(counts) > 0, counts  # spread over both replicas
        seq = 0
        for p in range(0, 4):
            seq += 1
            items = [
                DraftMaskItem(s, toks[p : p + 3], commit_tokens=toks[p - 1 : p] if p else [], commit_seq=seq)
                for s in sids
            ]
            router.draft_masks(items)
        # Kill replica 0: sessions living there are reopened on replica 1 with their tokens replayed.
        handles[0].stop(grace_s=0)
        p = 4
        seq += 1
        items = [DraftMaskItem(s, toks[p : p + 3], commit_tokens=toks[p - 1 : p], commit_seq=seq) for s in sids]
        results = router.draft_masks(items)
        expected = _expected(addresses[1], bpe_id, toks, p)
        for r in results:
            np.testing.assert_array_equal(r.bitmask.numpy(), expected)
        assert len(handles[1].sessions) >= 8
        # Replica 1 loses a session (TTL/restart): NOT_FOUND -> reopen + replay + retry.
        victim = router._sessions[sids[0]].remote_id
        handles[1].sessions.close(victim)
        p = 5
        seq += 1
        assert router.commit(sids[0], seq, toks[p - 1 : p]) is False
        res = router.draft_masks([DraftMaskItem(sids[0], toks[p : p + 3])])
        np.testing.assert_array_equal(res[0].bitmask.numpy(), _expected(addresses[1], bpe_id, toks, p))
        for s in sids:
            router.close_session(s)
        assert router.session_count() == 0
    finally:
        router.close()
        for h in handles:
            h.stop(grace_s=0)


def test_router_errors_name_router_session_ids(bpe_dir, registry, bpe_id, hf_tok) -> None:
    """A per-item failure in a batch spread over replicas names the caller's (router) session id,
    so the caller can drop that item and resend the rest (their commits are seen-seq no-ops)."""
    toks = hf_tok.encode(DOC, add_special_tokens=False)
    handles = [build_service(make_config(bpe_dir), registry) for _ in range(2)]
    for h in handles:
        h.server.start()
    addresses = [f"127.0.0.1:{h.port}" for h in handles]
    router = MaskRouter(addresses, deadline_s=5.0, max_retries=0)
    try:
        sids = _open_spread(router, bpe_id, 6)  # the batch spans both replicas
        p = 3
        items = [DraftMaskItem(s, toks[p : p + 3], commit_tokens=toks[:p], commit_seq=1) for s in sids]
        bad = 2
        items[bad] = DraftMaskItem(sids[bad], [10**6], commit_tokens=toks[:p], commit_seq=1)  # draft id out of range
        with pytest.raises(MaskServiceError) as err:
            router.draft_masks(items)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.session_id == sids[bad] != router._sessions[sids[bad]].remote_id

        # Resend without the failed item: commits some replicas already applied are no-ops.
        rest = [it for i, it in enumerate(items) if i != bad]
        results = router.draft_masks(rest)
        expected = _expected(addresses[0], bpe_id, toks, p)
        for r in results:
            np.testing.assert_array_equal(r.bitmask.numpy(), expected)
        assert all(router._sessions[it.session_id].last_seq == 1 for it in rest)

        # A session closed behind the router's back is recovered (reopen + replay), not raised.
        victim = sids[0]
        handles[addresses.index(router._sessions[victim].address)].sessions.close(router._sessions[victim].remote_id)
        results = router.draft_masks([DraftMaskItem(s, toks[p : p + 3]) for s in sids[:2]])
        for r in results:
            np.testing.assert_array_equal(r.bitmask.numpy(), expected)

        # commit: a token the grammar rejects (stop token 0 mid-string), and a token id out of range.
        for tokens, code in (([0], grpc.StatusCode.FAILED_PRECONDITION), ([10**6], grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(MaskServiceError) as err:
                router.commit(sids[1], 2, tokens)
            assert err.value.code == code and err.value.session_id == sids[1]
    finally:
        router.close()
        for h in handles:
            h.stop(grace_s=0)


def test_client_reaches_a_restarted_replica_within_seconds(bpe_dir, registry) -> None:
    """A replica down for half a minute, then back on its port: an existing client (what a
    router holds) uses it again within seconds. gRPC's default reconnect backoff would have
    grown past 10 s by then, failing every call fast with UNAVAILABLE long after the restart."""
    handle = build_service(make_config(bpe_dir), registry)
    handle.server.start()
    port = handle.port
    client = MaskServiceClient(f"127.0.0.1:{port}", deadline_s=1.0, max_retries=0)
    try:
        assert client.session_count() == 0
        handle.stop(grace_s=0)
        down_until = time.monotonic() + 32.0
        while time.monotonic() < down_until:  # keep calling, as a router would: backoff grows
            with pytest.raises(MaskServiceError) as err:
                client.session_count()
            assert err.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            time.sleep(0.5)
        handle = build_service(make_config(bpe_dir, port=port), registry)
        handle.server.start()
        restarted = time.monotonic()
        while True:
            try:
                assert client.session_count() == 0
                break
            except MaskServiceError:
                # Capped backoff: ~2.4 s at most; gRPC's default would exceed 10 s after 32 s down.
                assert time.monotonic() - restarted < 10.0, "restarted replica still unreachable after 10 s"
                time.sleep(0.1)
    finally:
        client.close()
        handle.stop(grace_s=0)


def test_router_release_owner_reaches_every_replica(bpe_dir, registry, bpe_id) -> None:
    """A crashed process's sessions, spread over replicas, are released by its successor
    (same owner); another owner's are untouched; an owner is required."""
    handles = [build_service(make_config(bpe_dir), registry) for _ in range(2)]
    for h in handles:
        h.server.start()
    addresses = [f"127.0.0.1:{h.port}" for h in handles]
    crashed = MaskRouter(addresses, owner="gpu-worker-1")
    other = MaskRouter(addresses, owner="gpu-worker-2")
    anonymous = MaskRouter(addresses)
    try:
        opened = _open_spread(crashed, bpe_id, 8)  # spread over both replicas
        kept = other.open_session(bpe_id, SCHEMA)
        successor = MaskRouter(addresses, owner="gpu-worker-1")  # crashed never closes its sessions
        try:
            assert successor.release_owner() == len(opened)
        finally:
            successor.close()
        assert sum(len(h.sessions) for h in handles) == 1
        other.commit(kept, 1, [])
        with pytest.raises(ValueError):
            anonymous.release_owner()
    finally:
        for r in (crashed, other, anonymous):
            r.close()
        for h in handles:
            h.stop(grace_s=0)


def test_own_connection_sees_a_restarted_replica_at_once(bpe_dir, registry) -> None:
    """A new client shares, by default, the connection of every other channel to that address in
    the process; while that connection is in reconnect backoff each call fails at once with its
    last error, past the new client's retries (0.35 s). A probe (the e2e stack's session count
    after restarting replicas: a CI flake) must see the replica as it is now: ``own_connection``."""
    from specmask.orchestrator.dev.local_stack import free_port

    port = free_port()
    address = f"127.0.0.1:{port}"
    failing = MaskServiceClient(address, deadline_s=1.0, max_retries=0)  # what the router holds
    handle = None
    try:
        for _ in range(20):  # ~1 s of failed calls: the shared connection is in backoff
            with pytest.raises(MaskServiceError):
                failing.session_count()
            time.sleep(0.05)
        handle = build_service(make_config(bpe_dir, port=port), registry)
        handle.server.start()
        with MaskServiceClient(address, deadline_s=5.0, max_retries=0, own_connection=True) as probe:
            assert probe.session_count() == 0  # first call, no retry
    finally:
        failing.close()
        if handle is not None:
            handle.stop(grace_s=0)


def test_router_answers_each_item_of_a_batch_on_its_own(bpe_dir, registry, bpe_id, hf_tok) -> None:
    """``draft_mask_items``: in one call, a refused item, a session the router never opened and
    a session a replica lost each get their own answer (the lost one recovered), and every
    other item its rows, commits recorded for the answered ones only. ``draft_masks`` over the
    same kind of batch raises the first failure, as before."""
    toks = hf_tok.encode(DOC, add_special_tokens=False)
    handles = [build_service(make_config(bpe_dir), registry) for _ in range(2)]
    for h in handles:
        h.server.start()
    addresses = [f"127.0.0.1:{h.port}" for h in handles]
    router = MaskRouter(addresses, deadline_s=5.0, max_retries=0)
    try:
        sids = _open_spread(router, bpe_id, 6)  # the batch spans both replicas
        p = 3
        items = [DraftMaskItem(s, toks[p : p + 3], commit_tokens=toks[:p], commit_seq=1) for s in sids]
        bad, lost = 2, 4
        items[bad] = DraftMaskItem(sids[bad], [10**6], commit_tokens=toks[:p], commit_seq=1)  # draft id out of range
        items.insert(1, DraftMaskItem("never-opened", toks[p : p + 3]))
        victim = router._sessions[sids[lost]]
        victim_remote = victim.remote_id
        handles[addresses.index(victim.address)].sessions.close(victim_remote)
        outcomes = router.draft_mask_items(items)
        assert len(outcomes) == len(items)
        expected = _expected(addresses[0], bpe_id, toks, p)
        for it, out in zip(items, outcomes):
            if it.session_id == sids[bad]:
                assert isinstance(out, MaskServiceError) and out.code == grpc.StatusCode.INVALID_ARGUMENT
                assert out.session_id == sids[bad] != router._sessions[sids[bad]].remote_id
                assert router._sessions[sids[bad]].last_seq == 0  # a failed item's commit is not recorded
            elif it.session_id == "never-opened":
                assert isinstance(out, MaskServiceError) and out.code == grpc.StatusCode.NOT_FOUND
                assert out.session_id == "never-opened"
            else:
                assert not isinstance(out, MaskServiceError), (it.session_id, out)
                np.testing.assert_array_equal(out.bitmask.numpy(), expected)
                assert router._sessions[it.session_id].last_seq == 1
        assert router._sessions[sids[lost]].remote_id != victim_remote  # reopened, replayed, answered
        with pytest.raises(MaskServiceError) as err:
            router.draft_masks([DraftMaskItem(sids[0], toks[p : p + 3]), DraftMaskItem(sids[bad], [10**6])])
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.session_id == sids[bad]
        with MaskServiceClient(addresses[0]) as client:  # one replica's client: the same per-item answers
            sid = client.open_session(bpe_id, SCHEMA)
            good, refused = client.draft_mask_items([DraftMaskItem(sid, toks[:3]), DraftMaskItem("nope", [])])
            assert isinstance(refused, MaskServiceError) and refused.code == grpc.StatusCode.NOT_FOUND
            assert refused.session_id == "nope"
            assert not isinstance(good, MaskServiceError) and good.num_grammar_accepted == 3
    finally:
        router.close()
        for h in handles:
            h.stop(grace_s=0)
