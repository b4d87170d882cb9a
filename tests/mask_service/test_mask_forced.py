"""Forced continuations in DraftMasks replies (specmask/mask_service/grammar/forced.py), both engines, real gRPC.

Checked: forced tokens spell a prefix of the text the grammar forces, every one is
accepted by the grammar (committing them succeeds), asking for them never changes
committed state (the same request answers the same rows and tokens twice), the cap
holds, an ambiguous last token is held back, nothing is computed when not asked, and
the rows after forced tokens (``forced_rows``) are bit for bit the rows the walk gives
over the same tokens as drafts.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceClient
from specmask.mask_service.grammar.forced import single_allowed

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
    "required": ["name", "age", "email"],
}
ENGINES = ("xgrammar", "llguidance")


def _spec(backend: str) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA), backend=backend)


def _ids(hf_tok: Any, text: str) -> list[int]:
    return list(hf_tok.encode(text, add_special_tokens=False))


def _text(hf_tok: Any, ids: list[int] | tuple[int, ...]) -> str:
    return hf_tok.decode(list(ids))


@pytest.mark.parametrize("backend", ENGINES)
def test_forced_key_is_accepted_and_state_unchanged(
    client: MaskServiceClient, bpe_id: str, hf_tok: Any, backend: str
) -> None:
    sid = client.open_session(bpe_id, _spec(backend))
    prefix = _ids(hf_tok, '{"name":"Bob","')
    commit, drafts = prefix[:-2], prefix[-2:]
    item = DraftMaskItem(
        sid, drafts, commit_tokens=commit, commit_seq=1, last_row_only=True, forced_up_to=len(drafts) + 8
    )
    first = client.draft_masks([item])[0]
    again = client.draft_masks([item])[0]  # the commit is a no-op now; the answer must not move
    assert first.num_grammar_accepted == len(drafts)
    assert first.forced_tokens, "the grammar forces the key 'age\":' here"
    assert again.forced_tokens == first.forced_tokens
    assert np.array_equal(again.bitmask.numpy(), first.bitmask.numpy())
    assert 'age":'.startswith(_text(hf_tok, first.forced_tokens))
    # Not asked: nothing computed.
    plain = client.draft_masks([DraftMaskItem(sid, drafts, last_row_only=True)])[0]
    assert plain.forced_tokens == ()
    # Every forced token is grammar-accepted: committing drafts + forced succeeds, and the
    # row after them is the row the walk gives over the same tokens as drafts.
    walked = client.draft_masks([DraftMaskItem(sid, [*drafts, *first.forced_tokens], last_row_only=True)])[0]
    assert walked.num_grammar_accepted == len(drafts) + len(first.forced_tokens)
    assert not client.commit(sid, 2, [*drafts, *first.forced_tokens])
    client.close_session(sid)


@pytest.mark.parametrize("backend", ENGINES)
def test_forced_cap_and_start_state(client: MaskServiceClient, bpe_id: str, hf_tok: Any, backend: str) -> None:
    sid = client.open_session(bpe_id, _spec(backend))
    # At the start the schema forces '{"name":"': capped at one token, then uncapped.
    one = client.draft_masks([DraftMaskItem(sid, [], forced_up_to=1)])[0]
    more = client.draft_masks([DraftMaskItem(sid, [], forced_up_to=8)])[0]
    assert len(one.forced_tokens) == 1 and more.forced_tokens[:1] == one.forced_tokens
    assert '{"name":"'.startswith(_text(hf_tok, more.forced_tokens))
    client.close_session(sid)


@pytest.mark.parametrize("backend", ENGINES)
def test_forced_at_a_refused_draft(client: MaskServiceClient, bpe_id: str, hf_tok: Any, backend: str) -> None:
    """``forced_up_to``: the forced continuation where the walk stops, also before a refused
    draft, capped so drafts + forced tokens stay within it; the same as asking that state
    directly; committed state unchanged."""
    sid = client.open_session(bpe_id, _spec(backend))
    accepted = _ids(hf_tok, '{"name":"Bob","')
    refused = _ids(hf_tok, "[")
    item = DraftMaskItem(sid, [*accepted, *refused], forced_up_to=len(accepted) + 8)
    res = client.draft_masks([item])[0]
    assert res.num_grammar_accepted == len(accepted) and res.forced_at_stop
    direct = client.draft_masks([DraftMaskItem(sid, accepted, last_row_only=True, forced_up_to=len(accepted) + 8)])[0]
    assert res.forced_tokens and res.forced_tokens == direct.forced_tokens
    assert 'age":'.startswith(_text(hf_tok, res.forced_tokens))
    assert client.draft_masks([item])[0].forced_tokens == res.forced_tokens  # state unchanged
    capped = client.draft_masks([DraftMaskItem(sid, [*accepted, *refused], forced_up_to=len(accepted) + 1)])[0]
    assert capped.forced_tokens == res.forced_tokens[:1]
    full = client.draft_masks([DraftMaskItem(sid, [*accepted, *refused], forced_up_to=len(accepted))])[0]
    assert full.forced_at_stop and full.forced_tokens == ()  # no room left
    # Every forced token follows the accepted drafts in the grammar.
    assert not client.commit(sid, 1, [*accepted, *res.forced_tokens])
    client.close_session(sid)


@pytest.mark.parametrize("backend", ("xgrammar", "llguidance"))
def test_forced_ambiguous_boundary(client: MaskServiceClient, bpe_id: str, hf_tok: Any, backend: str) -> None:
    """The test tokenizer has 'ag' and 'age'. Under 'ag(e|a)' the forced text is 'ag', but the
    grammar also allows 'age' there: the boundary after 'ag' is ambiguous, so nothing is
    forced. Under 'aga' the whole text is forced and its last token ends the language."""
    assert _ids(hf_tok, "ag") == [hf_tok.convert_tokens_to_ids("ag")] and hf_tok.convert_tokens_to_ids("age") > 0
    ambiguous = client.open_session(bpe_id, GrammarSpec(GrammarKind.REGEX, "ag(e|a)", backend=backend))
    assert client.draft_masks([DraftMaskItem(ambiguous, [], forced_up_to=8)])[0].forced_tokens == ()
    whole = client.open_session(bpe_id, GrammarSpec(GrammarKind.REGEX, "aga", backend=backend))
    res = client.draft_masks([DraftMaskItem(whole, [], forced_up_to=8)])[0]
    assert _text(hf_tok, res.forced_tokens) == "aga" and list(res.forced_tokens) == _ids(hf_tok, "aga")
    assert not client.commit(whole, 1, list(res.forced_tokens))
    for sid in (ambiguous, whole):
        client.close_session(sid)


def _forced_rows_match_the_walk(client: MaskServiceClient, sid: str, drafts: list[int], item: DraftMaskItem) -> int:
    """Ask ``item`` (forced_rows set) and check its forced rows against a walk over the accepted
    drafts + forced tokens as drafts: the same rows, bit for bit, one per forced token.
    Returns how many forced tokens (and rows) came."""
    res = client.draft_masks([item])[0]
    forced = list(res.forced_tokens)
    if not forced:
        assert res.forced_rows is None
        return 0
    assert res.forced_rows is not None and len(res.forced_rows) == len(forced)
    accepted = drafts[: res.num_grammar_accepted]
    walked = client.draft_masks([DraftMaskItem(sid, [*accepted, *forced])])[0]
    assert walked.num_grammar_accepted == len(accepted) + len(forced)
    expected = walked.rows.dense()[len(accepted) + 1 :]
    assert np.array_equal(res.forced_rows.dense(), expected)
    # The rows before the forced ones are what the same request without forced_rows answers.
    plain = client.draft_masks([DraftMaskItem(sid, drafts, last_row_only=item.last_row_only)])[0]
    assert np.array_equal(res.rows.dense(), plain.rows.dense())
    return len(forced)


@pytest.mark.parametrize("backend", ENGINES)
def test_forced_rows_are_the_walks_rows(client: MaskServiceClient, bpe_id: str, hf_tok: Any, backend: str) -> None:
    """``forced_rows``: the row after each forced token, in the same reply, after the walk at
    every kind of request (last row only, every row, a refused draft, the start state), also
    after a run that ends the language. Not asked (or nothing forced): none."""
    sid = client.open_session(bpe_id, _spec(backend))
    after_value = _ids(hf_tok, '{"name":"Bob","')
    refused = [*after_value, *_ids(hf_tok, "[")]
    counts = [
        _forced_rows_match_the_walk(
            client,
            sid,
            after_value,
            DraftMaskItem(sid, after_value, last_row_only=True, forced_up_to=len(after_value) + 8, forced_rows=True),
        ),
        _forced_rows_match_the_walk(
            client,
            sid,
            after_value,
            DraftMaskItem(sid, after_value, forced_up_to=len(after_value) + 8, forced_rows=True),
        ),
        _forced_rows_match_the_walk(
            client, sid, refused, DraftMaskItem(sid, refused, forced_up_to=len(after_value) + 8, forced_rows=True)
        ),
        _forced_rows_match_the_walk(client, sid, [], DraftMaskItem(sid, [], forced_up_to=8, forced_rows=True)),
    ]
    assert all(counts), counts  # every one of these states forces text
    capped = client.draft_masks([DraftMaskItem(sid, [], forced_up_to=1, forced_rows=True)])[0]
    assert len(capped.forced_tokens) == 1 and capped.forced_rows is not None and len(capped.forced_rows) == 1
    unasked = client.draft_masks(
        [DraftMaskItem(sid, after_value, last_row_only=True, forced_up_to=len(after_value) + 8)]
    )[0]
    assert unasked.forced_tokens and unasked.forced_rows is None
    # A run that ends the language: the row after it allows the stop token alone, as the walk's does.
    whole = client.open_session(bpe_id, GrammarSpec(GrammarKind.REGEX, "aga", backend=backend))
    res = client.draft_masks([DraftMaskItem(whole, [], forced_up_to=8, forced_rows=True)])[0]
    assert _text(hf_tok, res.forced_tokens) == "aga" and res.forced_rows is not None
    assert res.forced_rows[-1].allowed_count == 1 and single_allowed(res.forced_rows.dense()[-1], 1 << 20) == 0
    assert _forced_rows_match_the_walk(client, whole, [], DraftMaskItem(whole, [], forced_up_to=8, forced_rows=True))
    for s in (sid, whole):
        client.close_session(s)


def test_single_allowed() -> None:
    row = np.zeros(4, dtype=np.int32)
    assert single_allowed(row, 128) is None
    row[2] = 1 << 5
    assert single_allowed(row, 128) == 69
    row[2] = np.int32(-(1 << 31))  # bit 31 of a word
    assert single_allowed(row, 128) == 95
    assert single_allowed(row, 90) is None  # past the vocab: padding
    row[1] = 1
    assert single_allowed(row, 128) is None


def test_open_session_warms_the_forced_view_off_the_request_path(bpe_dir: Any, registry: Any, bpe_id: str) -> None:
    """OpenSession starts the tokenizer's forced-continuation view in the background: it is
    built with no DraftMasks call, built once, and the first forced request then uses it."""
    import time

    from specmask.mask_service.server.server import build_service
    from tests.mask_service.service_config import make_config

    handle = build_service(make_config(bpe_dir, max_sessions=20, max_batch=8, max_k=8), registry)
    handle.server.start()
    client = MaskServiceClient(f"127.0.0.1:{handle.port}", deadline_s=120.0)
    try:
        views = handle._parts[1].forced_views
        assert views is not None and views.builds == 0
        sid = client.open_session(bpe_id, _spec("xgrammar"))
        deadline = time.monotonic() + 60
        while views.builds == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert views.builds == 1, "the view was not built after OpenSession"
        res = client.draft_masks([DraftMaskItem(sid, [], forced_up_to=8)])[0]
        assert res.forced_tokens, 'the schema forces \'{"name":"\' at the start'
        other = client.open_session(bpe_id, _spec("llguidance"))  # same tokenizer: nothing to build
        assert client.draft_masks([DraftMaskItem(other, [], forced_up_to=8)])[0].forced_tokens
        assert views.builds == 1
    finally:
        client.close()
        handle.stop(grace_s=1.0)


def test_tokenizer_views_build_each_key_once(registry: Any, bpe_id: str) -> None:
    """A get() while warm() is building waits for that build; a failed build raises and is retried."""
    from specmask.mask_service.grammar.forced import TokenizerViews

    views = TokenizerViews(registry)
    info = registry.info(bpe_id, None)
    try:
        future = views.warm(bpe_id, info)
        assert future is not None
        view = views.get(bpe_id, info)
        assert future.result(timeout=60) is view and views.builds == 1
        assert views.warm(bpe_id, info) is None and views.get(bpe_id, info) is view
        with pytest.raises(Exception, match="nope"):
            views.get("nope", info)
        failed = views.warm("nope", info)
        assert failed is not None and failed.exception(timeout=60) is not None
        assert views.builds == 1
    finally:
        views.shutdown()


@pytest.mark.parametrize("backend", ENGINES)
def test_forced_runs_learn_the_targets_spelling(
    client: MaskServiceClient, bpe_id: str, hf_tok: Any, backend: str
) -> None:
    """grammar/spellings.py: where the target commits another spelling of a forced text than
    the canonical one, the session's later runs over that text start with the target's token
    (once it has more votes), spell the same bytes, and are grammar-accepted token by token
    with rows bit-exact to the walk's. Votes are the session's own: another session, at the
    same state, still gets the canonical spelling, unless it asks for the pooled votes
    (``shared_spellings``, sent for greedy requests)."""
    spec = GrammarSpec(GrammarKind.REGEX, "(age:){4}", backend=backend)
    canonical = _ids(hf_tok, "age:")
    other = [hf_tok.convert_tokens_to_ids("ag"), *_ids(hf_tok, "e:")]
    assert canonical[0] != other[0] and _text(hf_tok, other) == "age:"
    sid = client.open_session(bpe_id, spec)
    first = client.draft_masks([DraftMaskItem(sid, [], forced_up_to=4, forced_rows=True)])[0]
    assert list(first.forced_tokens[:1]) == canonical[:1]  # nothing learned yet: canonical
    # The target spells the first "age:" its own way (the next step's request carries it).
    item = DraftMaskItem(sid, [], commit_tokens=other, commit_seq=1, forced_up_to=4, forced_rows=True)
    assert _forced_rows_match_the_walk(client, sid, [], item)
    learned = client.draft_masks([DraftMaskItem(sid, [], forced_up_to=4)])[0]
    assert learned.forced_tokens[0] == other[0], learned.forced_tokens
    assert "age:age:age:".startswith(_text(hf_tok, learned.forced_tokens))
    assert not client.commit(sid, 2, list(learned.forced_tokens))  # every token grammar-accepted
    fresh = client.open_session(bpe_id, spec)
    assert list(client.draft_masks([DraftMaskItem(fresh, [], forced_up_to=4)])[0].forced_tokens[:1]) == canonical[:1]
    # A greedy request's session may ask for the votes pooled over every session.
    pooled = client.draft_masks([DraftMaskItem(fresh, [], forced_up_to=4, shared_spellings=True)])[0]
    assert pooled.forced_tokens[0] == other[0], pooled.forced_tokens
    for s in (sid, fresh):
        client.close_session(s)


def test_spelling_votes() -> None:
    """A token replaces the canonical one only with strictly more votes; ties keep the canonical."""
    from specmask.mask_service.grammar.spellings import Spellings

    votes = Spellings()
    assert not votes and votes.preferred(7) is None
    votes.vote(7, 8)
    assert votes.preferred(7) == 8
    votes.vote(7, 7)
    assert votes.preferred(7) is None  # 1 : 1
    votes.vote(7, 9)
    votes.vote(7, 9)
    assert votes.preferred(7) == 9 and votes.preferred(8) is None
