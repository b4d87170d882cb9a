"""Session semantics: masks never move committed state, idempotent commits, rollback, TTL, limits, concurrency."""

from __future__ import annotations

import json
import threading
import time

import grpc
import numpy as np
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceClient, MaskServiceError
from specmask.mask_service.server.server import build_service
from tests.mask_service.service_config import make_config

SCHEMA = GrammarSpec(
    GrammarKind.JSON_SCHEMA,
    json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
            "required": ["name", "count"],
        }
    ),
)
DOC = '{"name":"hello world","count":42}'


def _rows(client: MaskServiceClient, sid: str, drafts: list[int]) -> np.ndarray:
    return client.draft_masks([DraftMaskItem(sid, drafts)])[0].bitmask.numpy().copy()


def test_masks_leave_committed_state_unchanged(client, bpe_id, hf_tok) -> None:
    toks = hf_tok.encode(DOC, add_special_tokens=False)
    sid = client.open_session(bpe_id, SCHEMA)
    client.commit(sid, 1, toks[:2])
    before = _rows(client, sid, [])
    for drafts in (toks[2:6], toks[2:4] + [5], [5, 6, 7], toks[2:8]):
        client.draft_masks([DraftMaskItem(sid, drafts)])
        np.testing.assert_array_equal(_rows(client, sid, []), before)
    # The committed state still accepts the true continuation.
    assert client.draft_masks([DraftMaskItem(sid, toks[2:6])])[0].num_grammar_accepted == 4


def test_commit_idempotent_and_rollback(client, bpe_id, hf_tok) -> None:
    toks = hf_tok.encode(DOC, add_special_tokens=False)
    sid = client.open_session(bpe_id, SCHEMA)
    assert client.commit(sid, 1, toks[:3]) is False
    after3 = _rows(client, sid, [])
    client.commit(sid, 1, toks[:3])  # retried commit: no-op
    np.testing.assert_array_equal(_rows(client, sid, []), after3)
    # A rejected token mid-commit rolls back the accepted prefix.
    with pytest.raises(MaskServiceError) as exc:
        client.commit(sid, 2, [toks[3], toks[4], 0])  # 0 = stop token, not allowed mid-document
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
    np.testing.assert_array_equal(_rows(client, sid, []), after3)
    # The same seq may be used again after a rejection (nothing was applied).
    client.commit(sid, 2, toks[3:])
    stop = 0  # the fixture tokenizer's <|endoftext|>
    assert client.commit(sid, 3, [stop]) is True
    # Commit riding on draft_masks, retried: applied once.
    sid2 = client.open_session(bpe_id, SCHEMA)
    for _ in range(2):
        res = client.draft_masks([DraftMaskItem(sid2, toks[2:4], commit_tokens=toks[:2], commit_seq=1)])
        assert res[0].num_grammar_accepted == 2


def test_session_ttl_and_limits(bpe_dir, registry, bpe_id) -> None:
    handle = build_service(
        make_config(bpe_dir, max_sessions=2, session_ttl_s=2.0, janitor_interval_s=0.2, max_batch=2, max_k=3), registry
    )
    handle.server.start()
    try:
        c = MaskServiceClient(f"127.0.0.1:{handle.port}", deadline_s=20.0)
        a = c.open_session(bpe_id, SCHEMA)
        b = c.open_session(bpe_id, SCHEMA)
        with pytest.raises(MaskServiceError) as exc:
            c.open_session(bpe_id, SCHEMA)
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(MaskServiceError) as exc:
            c.draft_masks([DraftMaskItem(a, [1, 2, 3, 4])])
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT  # k > max_k
        with pytest.raises(MaskServiceError) as exc:
            c.draft_masks([DraftMaskItem(a, [])] * 3)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT  # batch > max_batch
        # TTL 2 s: long enough that a loaded box cannot evict `a` before the limit checks above.
        deadline = time.monotonic() + 15
        while c.session_count() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.session_count() == 0
        with pytest.raises(MaskServiceError) as exc:
            c.draft_masks([DraftMaskItem(b, [])])
        assert exc.value.code == grpc.StatusCode.NOT_FOUND and exc.value.session_id == b
        c.open_session(bpe_id, SCHEMA)  # room again after eviction
        c.close()
    finally:
        handle.stop(grace_s=0.5)


def test_concurrent_clients(service, bpe_id, hf_tok) -> None:
    toks = hf_tok.encode(DOC, add_special_tokens=False)
    errors: list[BaseException] = []
    address = f"127.0.0.1:{service.port}"
    with MaskServiceClient(address) as ref_client:
        expected = []
        for p in range(len(toks) - 3):
            sid = ref_client.open_session(bpe_id, SCHEMA)
            res = ref_client.draft_masks([DraftMaskItem(sid, toks[p : p + 3], commit_tokens=toks[:p], commit_seq=1)])
            expected.append(res[0].bitmask.numpy().copy())
            ref_client.close_session(sid)

    def worker(n: int) -> None:
        try:
            with MaskServiceClient(address, deadline_s=30.0) as c:
                sids = [c.open_session(bpe_id, SCHEMA) for _ in range(3)]
                for p in range(len(toks) - 3):
                    res = c.draft_masks(
                        [
                            DraftMaskItem(
                                s, toks[p : p + 3], commit_tokens=toks[p - 1 : p] if p else [], commit_seq=p + 1
                            )
                            for s in sids
                        ]
                    )
                    for r in res:
                        np.testing.assert_array_equal(r.bitmask.numpy(), expected[p])
                for s in sids:
                    c.close_session(s)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_release_owner_closes_only_that_owners_sessions(client, bpe_id, hf_tok) -> None:
    toks = hf_tok.encode(DOC, add_special_tokens=False)
    mine = [client.open_session(bpe_id, SCHEMA, owner="worker-a") for _ in range(3)]
    other = client.open_session(bpe_id, SCHEMA, owner="worker-b")
    unnamed = client.open_session(bpe_id, SCHEMA)
    before = client.session_count()
    assert client.release_owner("worker-a") == 3
    assert client.session_count() == before - 3
    for sid in mine:
        with pytest.raises(MaskServiceError) as err:
            client.commit(sid, 1, toks[:1])
        assert err.value.code == grpc.StatusCode.NOT_FOUND
    for sid in (other, unnamed):  # untouched, still serving
        client.commit(sid, 1, toks[:1])
        assert _rows(client, sid, toks[1:3]).shape[0] == 3
    assert client.release_owner("worker-a") == 0  # nothing left: a retry is a no-op
    for bad in ("", "x" * 257):
        with pytest.raises(MaskServiceError) as err:
            client.release_owner(bad)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(MaskServiceError) as err:
        client.open_session(bpe_id, SCHEMA, owner="x" * 257)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert client.release_owner("worker-b") == 1
    client.close_session(unnamed)


def test_close_session_needs_the_owner_that_opened_it(client, bpe_id, hf_tok) -> None:
    # Session ids are logged; owners are not. Knowing an id must not let a caller end
    # another owner's session (its request would fail with "unknown session").
    toks = hf_tok.encode(DOC, add_special_tokens=False)
    sid = client.open_session(bpe_id, SCHEMA, owner="worker-a")
    for wrong in ("", "worker-b", "worker-a "):
        with pytest.raises(MaskServiceError) as err:
            client.close_session(sid, owner=wrong)
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    client.commit(sid, 1, toks[:1])  # still open and serving
    assert _rows(client, sid, toks[1:3]).shape[0] == 3
    client.close_session(sid, owner="worker-a")
    with pytest.raises(MaskServiceError) as err:
        client.commit(sid, 2, toks[1:2])
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    unnamed = client.open_session(bpe_id, SCHEMA)  # opened without an owner: anyone may close it
    before = client.session_count()
    client.close_session(unnamed)
    assert client.session_count() == before - 1
