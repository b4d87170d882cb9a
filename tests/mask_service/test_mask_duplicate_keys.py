"""Repeated keys in open maps are refused while decoding (grammar/json_keys.py).

Real engines (xgrammar, llguidance) over the trained test BPE, through the sessions
and the draft walk the service runs. Each row is checked bit for bit against the
engine's own row with exactly the tokens cleared that an independent whole-text scan
says would close a repeated key.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.grammar.json_keys import DuplicateKeyGuard, decode_key
from specmask.mask_service.server.compiler_cache import CompilerCache
from specmask.mask_service.server.draft_masks import walk_drafts
from specmask.mask_service.server.sessions import Session, SessionStore
from specmask.mask_service.server.tokenizers import TokenizerRegistry

ENGINES = ("xgrammar", "llguidance")
OPEN_MAP = {"type": "object", "additionalProperties": {"type": "integer"}}
NESTED = {"type": "object", "additionalProperties": {"anyOf": [{"type": "integer"}, OPEN_MAP]}}


def _repeats_in(text: bytes, start: int) -> bool:
    """Whether a key string whose closing quote lies at or after byte ``start`` repeats an
    earlier key of its object (a whole-text scan, independent of the guard's bookkeeping)."""
    stack: list[set[str] | None] = []
    expect_key: list[bool] = []
    i = 0
    while i < len(text):
        c = text[i : i + 1]
        if c == b'"':
            is_key = bool(stack) and stack[-1] is not None and expect_key[-1]
            j = i + 1
            while j < len(text) and text[j : j + 1] != b'"':
                j += 2 if text[j : j + 1] == b"\\" else 1
            if j >= len(text):
                return False  # the string is still open
            if is_key:
                key = json.loads(text[i : j + 1])
                keys = stack[-1]
                assert keys is not None
                if key in keys and j >= start:
                    return True
                keys.add(key)
                expect_key[-1] = False
            i = j + 1
            continue
        if c == b"{":
            stack.append(set())
            expect_key.append(True)
        elif c == b"[":
            stack.append(None)
            expect_key.append(False)
        elif c in (b"}", b"]"):
            stack.pop()
            expect_key.pop()
        elif c == b"," and stack and stack[-1] is not None:
            expect_key[-1] = True
        i += 1
    return False


def _bits(row: np.ndarray) -> set[int]:
    words = row.view(np.uint32)
    return {w * 32 + b for w in np.flatnonzero(words) for b in range(32) if (int(words[w]) >> b) & 1}


@pytest.fixture(scope="module")
def caches(registry: TokenizerRegistry) -> dict[str, CompilerCache]:
    return {
        name: CompilerCache(registry, max_bytes=1 << 28, compile_threads=1, compile_timeout_s=120, backend=name)
        for name in ENGINES
    }


def _session(caches: dict[str, CompilerCache], bpe_id: str, backend: str, schema: Any = None) -> Session:
    kind = GrammarKind.ANY_JSON if schema is None else GrammarKind.JSON_SCHEMA
    spec = GrammarSpec(kind, "" if schema is None else json.dumps(schema))
    entry, _ = caches[backend].get(bpe_id, None, spec)
    session = SessionStore(max_sessions=4, ttl_s=600).open(entry, entry.vocab_size)
    assert isinstance(session.matcher, DuplicateKeyGuard)
    return session


def _commit(session: Session, hf_tok: Any, text: str) -> list[int]:
    ids = list(hf_tok.encode(text, add_special_tokens=False))
    assert session.commit_locked(session.last_seq + 1, ids)
    return ids


def _rows(session: Session) -> tuple[np.ndarray, np.ndarray]:
    """(the guarded row, the engine's own row) at the session's committed state."""
    guard = session.matcher
    assert isinstance(guard, DuplicateKeyGuard)
    rows = np.zeros((2, session.num_mask_words), dtype=np.int32)
    guard.fill_next_token_bitmask(rows, 0)
    guard.inner.fill_next_token_bitmask(rows, 1)
    return rows[0], rows[1]


def _expected(engine_row: np.ndarray, prefix: bytes, token_bytes: list[bytes]) -> np.ndarray:
    out = engine_row.copy().view(np.uint32)
    for t in _bits(engine_row):
        data = token_bytes[t] if t < len(token_bytes) else b""
        if data and _repeats_in(prefix + data, len(prefix)):
            out[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    return out.view(np.int32)


def _vocab_bytes(registry: TokenizerRegistry, bpe_id: str) -> list[bytes]:
    return [bytes(b) for b in registry.info(bpe_id, None).decoded_vocab]


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize(
    ("schema", "prefix", "repeated"),
    [
        (OPEN_MAP, '{"a":1,"a', "a"),  # the key typed in full: its closing quote is refused
        (OPEN_MAP, '{"name":1,"name', "name"),  # a longer key, tokens that close and go on
        (OPEN_MAP, '{"ab":1,"a\\u0062', "ab"),  # an escape spelling the earlier key
        (OPEN_MAP, '{"a\\u0062":1,"ab', "ab"),  # the earlier key had the escape
        (NESTED, '{"a":{"a":1,"a', "a"),  # the inner object's own keys
        (NESTED, '{"a":{"b":1},"a', "a"),  # back in the outer object
        (None, '{"type":1,"x":[{"type":2}],"type', "type"),  # any-JSON
    ],
)
def test_tokens_closing_a_repeated_key_are_cleared(
    caches: dict[str, CompilerCache],
    registry: TokenizerRegistry,
    bpe_id: str,
    hf_tok: Any,
    backend: str,
    schema: Any,
    prefix: str,
    repeated: str,
) -> None:
    session = _session(caches, bpe_id, backend, schema)
    _commit(session, hf_tok, prefix)
    guarded, engine = _rows(session)
    vocab = _vocab_bytes(registry, bpe_id)
    np.testing.assert_array_equal(guarded, _expected(engine, prefix.encode(), vocab))
    cleared = _bits(engine) - _bits(guarded)
    quote = hf_tok.convert_tokens_to_ids('"')
    assert cleared, "some token closes the repeated key"
    if prefix.endswith(repeated):
        assert quote in cleared
    assert _bits(guarded), "never an all-zero row"
    # The same tokens are refused when accepted one by one (drafts, forced tokens).
    for t in sorted(cleared):
        assert not session.matcher.accept_token(t)
        assert session.matcher.inner.accept_token(t)  # the engine alone takes it
        session.matcher.inner.rollback(1)


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize(
    ("schema", "prefix"),
    [
        (OPEN_MAP, '{"a":1,"b'),
        (OPEN_MAP, '{"a":1,"ab'),
        (NESTED, '{"a":{"b":1},"b'),  # "b" is the inner object's key, not the outer's
        (NESTED, '{"a":{"b":1,"c'),
    ],
)
def test_other_keys_are_unaffected(
    caches: dict[str, CompilerCache], bpe_id: str, hf_tok: Any, backend: str, schema: Any, prefix: str
) -> None:
    session = _session(caches, bpe_id, backend, schema)
    _commit(session, hf_tok, prefix)
    guarded, engine = _rows(session)
    np.testing.assert_array_equal(guarded, engine)


@pytest.mark.parametrize("backend", ENGINES)
def test_value_strings_are_not_keys(caches: dict[str, CompilerCache], bpe_id: str, hf_tok: Any, backend: str) -> None:
    schema = {"type": "object", "additionalProperties": {"type": "string"}}
    session = _session(caches, bpe_id, backend, schema)
    _commit(session, hf_tok, '{"a":"a')
    guarded, engine = _rows(session)
    np.testing.assert_array_equal(guarded, engine)


@pytest.mark.parametrize("backend", ENGINES)
def test_the_tracker_rolls_back_with_the_matcher(
    caches: dict[str, CompilerCache], bpe_id: str, hf_tok: Any, backend: str
) -> None:
    session = _session(caches, bpe_id, backend, OPEN_MAP)
    _commit(session, hf_tok, '{"a":1')
    drafts = list(hf_tok.encode(',"b":2,"b', add_special_tokens=False))
    out = np.zeros((len(drafts) + 1, session.num_mask_words), dtype=np.int32)
    accepted, _ = walk_drafts(session.matcher, drafts, out, False)
    assert accepted == len(drafts)
    # The last row is at '{"a":1,"b":2,"b': the quote closing a second "b" is cleared there.
    quote = hf_tok.convert_tokens_to_ids('"')
    assert quote not in _bits(out[-1])
    # The drafts were rolled back: "b" is not a key of the committed object.
    _commit(session, hf_tok, ',"b')
    guarded, engine = _rows(session)
    np.testing.assert_array_equal(guarded, engine)
    assert quote in _bits(guarded)
    # A commit refused half-way (here: at a repeated key it writes itself) leaves the
    # tracker where the matcher is.
    bad = list(hf_tok.encode('":2,"b":3', add_special_tokens=False))
    with pytest.raises(Exception, match="rejects"):
        session.commit_locked(session.last_seq + 1, bad)
    guarded, engine = _rows(session)
    np.testing.assert_array_equal(guarded, engine)


@pytest.mark.parametrize("backend", ENGINES)
def test_a_dead_end_keeps_the_engine_row(
    caches: dict[str, CompilerCache], bpe_id: str, hf_tok: Any, backend: str
) -> None:
    """Where only a repeated key can follow, the row is the engine's (never all-zero)
    and the token is accepted: the end check then fails the request, closed."""
    schema = {"type": "object", "patternProperties": {"^a$": {"type": "integer"}}, "additionalProperties": False}
    session = _session(caches, bpe_id, backend, schema)
    _commit(session, hf_tok, '{"a":1,"a')
    guarded, engine = _rows(session)
    np.testing.assert_array_equal(guarded, engine)
    assert _bits(guarded)
    assert session.matcher.accept_token(hf_tok.convert_tokens_to_ids('"'))


@pytest.mark.parametrize("backend", ENGINES)
def test_a_token_leading_into_a_dead_end_is_cleared(
    caches: dict[str, CompilerCache], bpe_id: str, hf_tok: Any, backend: str
) -> None:
    """Keys at most two letters long: after '{"ab":1,"a' the token 'b' would leave only the
    quote closing a second "ab", so the row refuses 'b' and still lets "a" close."""
    schema = {
        "type": "object",
        "patternProperties": {"^[ab]{1,2}$": {"type": "integer"}},
        "additionalProperties": False,
    }
    session = _session(caches, bpe_id, backend, schema)
    _commit(session, hf_tok, '{"ab":1,"a')
    guarded, engine = _rows(session)
    b = hf_tok.convert_tokens_to_ids("b")
    quote = hf_tok.convert_tokens_to_ids('"')
    assert b in _bits(engine) and b not in _bits(guarded)
    assert quote in _bits(guarded)
    assert not session.matcher.accept_token(b)
    assert session.matcher.inner.accept_token(b)
    session.matcher.inner.rollback(1)


@pytest.mark.parametrize("backend", ENGINES)
def test_forced_continuation_skips_the_repeated_key(
    caches: dict[str, CompilerCache], registry: TokenizerRegistry, bpe_id: str, hf_tok: Any, backend: str
) -> None:
    """Two names share 'ab': after '{"abc":1,"ab' only 'd' may follow, so the row forces it
    and the forced walk proposes the other key; the engine alone would force nothing."""
    from specmask.mask_service.server.draft_masks import DraftMaskEngine, DraftRequest
    from specmask.mask_service.wire import RowInterner

    schema = {
        "type": "object",
        "patternProperties": {"^ab[cd]$": {"type": "integer"}},
        "additionalProperties": False,
    }
    kind_spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    entry, _ = caches[backend].get(bpe_id, None, kind_spec)
    store = SessionStore(max_sessions=4, ttl_s=600)
    session = store.open(entry, entry.vocab_size)
    engine = DraftMaskEngine(store, RowInterner(1 << 20), num_threads=1, max_batch=4, max_k=8, tokenizers=registry)
    try:
        prefix = list(hf_tok.encode('{"abc":1,"ab', add_special_tokens=False))
        (out,), _ = engine.run([DraftRequest(session.session_id, (), prefix, 1, forced_up_to=4)])
        assert out.error is None
        forced = hf_tok.decode(out.forced_tokens)
        assert forced.startswith("d"), forced
        # The engine's own matcher at the same state would take the repeated key's 'c'.
        assert isinstance(session.matcher, DuplicateKeyGuard)
        c = hf_tok.convert_tokens_to_ids("c")
        assert not session.matcher.accept_token(c)
        assert session.matcher.inner.accept_token(c)
        session.matcher.inner.rollback(1)
    finally:
        engine.shutdown()


class _CountingFills:
    """The engine matcher, counting row fills (the look-ahead's cost)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fills = 0

    def accept_token(self, token_id: int, /) -> bool:
        return bool(self.inner.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.inner.is_terminated())

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int = 0, /) -> object:
        self.fills += 1
        return self.inner.fill_next_token_bitmask(bitmask, index)

    def rollback(self, num_tokens: int, /) -> None:
        self.inner.rollback(num_tokens)


@pytest.fixture(scope="module")
def llama3(shared_data: Any) -> tuple[str, dict[str, CompilerCache], Any]:
    """The Llama-3 tokenizer: it has the tokens "a", "aa", "aaa", "aaaa" (look-ahead chains)."""
    from transformers import PreTrainedTokenizerFast

    from specmask.common.tokenizer_id import tokenizer_id_for_path
    from specmask.mask_service.server.tokenizers import TokenizerSource

    path = shared_data / "tokenizers" / "llama3"
    reg = TokenizerRegistry([TokenizerSource(str(path))])
    caches = {
        name: CompilerCache(reg, max_bytes=1 << 30, compile_threads=1, compile_timeout_s=300, backend=name)
        for name in ENGINES
    }
    return tokenizer_id_for_path(path), caches, PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))


@pytest.mark.parametrize("backend", ENGINES)
def test_look_ahead_is_bounded(llama3: tuple[str, dict[str, CompilerCache], Any], backend: str) -> None:
    """Keys that prefix one another ("a", "aa", ...) chain look-aheads; a row and an
    accepted token cost at most 1 + MAX_LOOKAHEADS engine row fills, never a search."""
    from specmask.mask_service.grammar.json_keys import MAX_LOOKAHEADS

    tok_id, caches, hf = llama3
    schema = {"type": "object", "patternProperties": {"^a{1,8}$": {"type": "integer"}}, "additionalProperties": False}
    session = _session(caches, tok_id, backend, schema)
    _commit(session, hf, "{" + ",".join(f'"{"a" * n}":1' for n in range(1, 8)) + ',"')
    guard = session.matcher
    assert isinstance(guard, DuplicateKeyGuard)
    counting = _CountingFills(guard.inner)
    guard.inner = counting  # type: ignore[assignment]  # the same calls, counted
    row = np.zeros((1, session.num_mask_words), dtype=np.int32)
    guard.fill_next_token_bitmask(row, 0)
    assert 1 <= counting.fills <= 1 + MAX_LOOKAHEADS
    assert row.any()
    counting.fills = 0
    guard.accept_token(hf.convert_tokens_to_ids("a"))
    assert counting.fills <= 3 * (1 + MAX_LOOKAHEADS)


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("suffix", ["", "a", "b", "aa", "ba"])
def test_accept_agrees_with_the_row(
    caches: dict[str, CompilerCache], bpe_id: str, hf_tok: Any, backend: str, suffix: str
) -> None:
    """A token is accepted exactly where the row allows it (a row that allows a token the
    commit then refuses fails the request), also around dead ends and look-aheads."""
    schema = {
        "type": "object",
        "patternProperties": {"^[ab]{1,3}$": {"type": "integer"}},
        "additionalProperties": False,
    }
    session = _session(caches, bpe_id, backend, schema)
    keys = ["bbb", "bba", "bb", "ab", "a", "aaa"]
    _commit(session, hf_tok, "{" + ",".join(f'"{k}":1' for k in keys) + ',"' + suffix)
    guarded, engine = _rows(session)
    allowed = _bits(guarded)
    for t in sorted(_bits(engine)):
        accepted = session.matcher.accept_token(t)
        assert accepted == (t in allowed), (t, hf_tok.decode([t]))
        if accepted:
            session.matcher.rollback(1)
    np.testing.assert_array_equal(_rows(session)[0], guarded)


def _decode_by_json(raw: bytes) -> str | None:
    try:
        value = json.loads(b'"' + raw + b'"', strict=False)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, str) else None


def test_decode_key_matches_json_on_any_bytes() -> None:
    """decode_key's fast path (no escapes, quotes or control bytes) gives what json.loads gives,
    on random bytes, keys in several scripts, escapes, invalid UTF-8 and encoded surrogates."""
    rng = np.random.default_rng(7)
    cases = [b"", b"name", "naïve 名前 🙂".encode(), b"a\\u00e9b", b'a\\"b', b'a"b', b"\xff", b"\xed\xa0\x80", b"\x00x"]
    alphabet = np.frombuffer(b'ab\\"u0e9 \x00\x1f\x7f\xc3\xa9\xed\xa0\x80\xff', dtype=np.uint8)
    cases += [bytes(rng.choice(alphabet, size=rng.integers(0, 8))) for _ in range(4000)]
    cases += [bytes(rng.integers(0, 256, size=rng.integers(0, 6), dtype=np.uint8)) for _ in range(4000)]
    for raw in cases:
        assert decode_key(raw) == _decode_by_json(raw), raw
