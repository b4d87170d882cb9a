"""llguidance as the second grammar backend: same rows as xgrammar, state-neutral walks, replay, selection, no lies.

Rows: on grammars both engines accept, llguidance's row equals xgrammar's
except inside JSON strings, where llguidance never allows U+007F or the ``\\/``
escape (stricter, never looser): pinned token by token.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from bench.coverage import Case, Checker, Tally, run_case, serializations
from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceClient, MaskServiceError
from specmask.mask_service.client.router import MaskRouter
from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.backends import BACKENDS, SELECTION_ORDER, SelectedGrammar, SelectingBackend
from specmask.mask_service.server.draft_masks import walk_drafts
from specmask.mask_service.server.server import build_service
from specmask.mask_service.server.tokenizers import TokenizerRegistry
from tests.fixtures.shared_data import require
from tests.mask_service.service_config import make_config

DATA = Path(__file__).resolve().parents[1] / "data" / "maskbench"

# (schema, valid instance) pairs both engines accept; numbers, enums, nesting, strings, arrays.
BOTH: list[tuple[Any, Any]] = [
    ({"type": "integer", "minimum": -5, "maximum": 120}, 42),
    ({"enum": ["red", "green", 3, None]}, "green"),
    ({"type": "boolean"}, True),
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "n": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "n"],
        },
        {"name": "alpha beta", "n": 1234, "tags": ["x", "y"]},
    ),
    ({"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3}, [1.5, -2, 3e5]),
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "hello \u00e9\\n"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "x"),  # provably disjoint: anyOf semantics are exact
]
# Both engines refuse these (llguidance names them "Unimplemented keys" or cannot prove them).
REFUSED_BY_BOTH = [
    {"type": "array", "uniqueItems": True},
    {"not": {"type": "string"}},
    # Beside patternProperties the dependencies rewrite (exact_rewrites) does not expand it.
    {"type": "object", "patternProperties": {"^x": {}}, "dependencies": {"a": ["b"]}},
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
]
# xgrammar refuses (or would lie), llguidance enforces: (schema, valid instances, invalid instances).
LLGUIDANCE_ONLY: list[tuple[Any, list[Any], list[Any]]] = [
    (
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]},
            ]
        },
        [{"a": 1, "b": "x"}],
        [{"a": 1}, {"b": "x"}, {"a": "1", "b": "x"}],
    ),
    ({"type": "integer", "multipleOf": 3}, [0, 9, -6], [1, 10, 3.5]),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}, ["abc", "a"], ["abcdef", "ABC", ""]),
    # Two patterns again: the anyOf distribution (exact_rewrites) cannot merge them.
    (
        {"type": "string", "pattern": "^a", "anyOf": [{"pattern": "b$"}, {"maxLength": 1}]},
        ["ab", "axb", "a"],
        ["b", "ba", "ax"],
    ),
    ({"$ref": "#/$defs/n", "maximum": 3, "$defs": {"n": {"type": "integer", "minimum": 1}}}, [1, 3], [0, 4, "2"]),
]


def _spec(schema: Any, **kw: Any) -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), **kw)


def _bits(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def _known_difference(token: bytes) -> bool:
    """Tokens xgrammar allows inside a JSON string and llguidance does not."""
    return b"\x7f" in token or b"\\/" in token or token.startswith(b"/")


class _Engines:
    def __init__(self, info: Any) -> None:
        self.auto = SelectingBackend()
        self.compilers = self.auto.make_compiler(info, 1)
        self.vocab = [bytes(t) for t in info.decoded_vocab]
        self.width = (info.vocab_size + 31) // 32
        self.stop = int(info.stop_token_ids[0])

    def compile(self, spec: GrammarSpec) -> SelectedGrammar:
        return self.auto.compile(self.compilers, spec)

    def rows(self, compiled: SelectedGrammar, tokens: list[int]) -> tuple[list[np.ndarray], bool]:
        """Rows M_0..M_n along ``tokens`` and whether every token was accepted."""
        m = self.auto.new_matcher(compiled)
        rows = []
        for t in tokens:
            row = np.zeros((1, self.width), dtype=np.int32)
            m.fill_next_token_bitmask(row, 0)
            rows.append(row[0])
            if not m.accept_token(t):
                return rows, False
        return rows, bool(m.is_terminated())


def _assert_same_rows(engines: _Engines, schema: Any, text: str, tokens: list[int]) -> int:
    """Walk ``tokens`` under both engines; returns how many rows were bit-identical."""
    x = engines.compile(_spec(schema, backend="xgrammar"))
    ll = engines.compile(_spec(schema, backend="llguidance"))
    assert (x.backend, ll.backend) == ("xgrammar", "llguidance")
    rx, okx = engines.rows(x, tokens)
    rl, okl = engines.rows(ll, tokens)
    assert okx and okl, f"{text!r} must be accepted by both engines"
    identical = 0
    for i, (a, b) in enumerate(zip(rx, rl)):
        if np.array_equal(a, b):
            identical += 1
            continue
        bx, bl = _bits(a, len(engines.vocab)), _bits(b, len(engines.vocab))
        assert not (bl & ~bx).any(), f"{text!r} row {i}: llguidance allows tokens xgrammar does not"
        extra = [engines.vocab[j] for j in np.flatnonzero(bx & ~bl)]
        assert all(_known_difference(t) for t in extra), f"{text!r} row {i}: unexpected differences {extra[:8]}"
    return identical


def test_rows_match_xgrammar_tiny_tokenizer(registry: TokenizerRegistry, bpe_id: str, hf_tok: Any) -> None:
    engines = _Engines(registry.info(bpe_id, None))
    identical = total = 0
    for schema, instance in BOTH:
        text = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
        tokens = [*hf_tok.encode(text, add_special_tokens=False), engines.stop]
        identical += _assert_same_rows(engines, schema, text, tokens)
        total += len(tokens)
    assert identical >= total * 0.6, (identical, total)  # the differences are the rare in-string rows


def test_rows_match_xgrammar_padded_vocab(registry: TokenizerRegistry, bpe_id: str, hf_tok: Any) -> None:
    """A model vocabulary wider than the tokenizer: padding ids are never allowed by either engine."""
    base = len(hf_tok)
    engines = _Engines(registry.info(bpe_id, base + 45))
    schema, instance = BOTH[3]
    text = json.dumps(instance, separators=(",", ":"))
    tokens = [*hf_tok.encode(text, add_special_tokens=False), engines.stop]
    _assert_same_rows(engines, schema, text, tokens)
    row, _ = engines.rows(engines.compile(_spec(schema, backend="llguidance")), tokens[:1])
    assert not _bits(row[0], base + 45)[base:].any()


@pytest.mark.slow
@pytest.mark.shared_data
def test_rows_match_xgrammar_llama3(shared_data: Path) -> None:
    from specmask.mask_service.server.tokenizers import TokenizerSource

    reg = TokenizerRegistry([TokenizerSource(str(require(shared_data, "tokenizers", "llama3")))])
    tid = reg.ids()[0]
    engines = _Engines(reg.info(tid, None))
    hf = reg.get(tid).hf_tokenizer
    checked = 0
    for f in sorted(DATA.glob("*.json"))[:12]:
        data = json.loads(f.read_text())
        try:
            engines.compile(_spec(data["schema"], backend="xgrammar"))
            engines.compile(_spec(data["schema"], backend="llguidance"))
        except GrammarError:
            continue
        for instance in [t["data"] for t in data["tests"] if t["valid"]][:1]:
            for text in serializations(instance, data["schema"]):
                tokens = [*hf.encode(text, add_special_tokens=False), engines.stop]
                x = engines.compile(_spec(data["schema"], backend="xgrammar"))
                if engines.rows(x, tokens)[1]:
                    _assert_same_rows(engines, data["schema"], text, tokens)
                    checked += 1
                    break
    assert checked >= 3, checked


def test_walk_leaves_state_untouched(registry: TokenizerRegistry, bpe_id: str, hf_tok: Any) -> None:
    engines = _Engines(registry.info(bpe_id, None))
    schema = LLGUIDANCE_ONLY[0][0]
    compiled = engines.compile(_spec(schema))
    assert compiled.backend == "llguidance"
    tokens = [*hf_tok.encode('{"a":12,"b":"xy"}', add_special_tokens=False), engines.stop]
    m = engines.auto.new_matcher(compiled)
    committed = 3
    for t in tokens[:committed]:
        assert m.accept_token(t)
    k = len(tokens) - committed
    first = np.full((k + 1, engines.width), -1, dtype=np.int32)
    accepted, filled = walk_drafts(m, tokens[committed:], first, False)
    assert accepted == k and all(filled[:k])  # walks to the stop token: terminated, then rolled back
    assert not m.is_terminated()
    again = np.full_like(first, -1)
    assert walk_drafts(m, tokens[committed:], again, False)[0] == k
    np.testing.assert_array_equal(first, again)
    # A rejected draft mid-way: rows up to it, state unchanged afterwards.
    bad = [*tokens[committed : committed + 2], engines.stop, tokens[committed + 2]]
    out = np.full((len(bad) + 1, engines.width), -1, dtype=np.int32)
    assert walk_drafts(m, bad, out, False)[0] == 2
    np.testing.assert_array_equal(out[:3], first[:3])
    for t in tokens[committed:]:
        assert m.accept_token(t)
    assert m.is_terminated()
    assert not m.accept_token(tokens[0])  # nothing after the stop token


def test_selection_is_deterministic(registry: TokenizerRegistry, bpe_id: str) -> None:
    info = registry.info(bpe_id, None)
    assert SELECTION_ORDER == ("xgrammar", "llguidance")
    for _ in range(2):  # fresh selectors pick the same engine
        engines = _Engines(info)
        for schema, _ in BOTH:
            assert engines.compile(_spec(schema)).backend == "xgrammar"
        for schema, _, _ in LLGUIDANCE_ONLY:
            chosen = engines.compile(_spec(schema))
            assert chosen.backend == "llguidance" and chosen.reasons[0].startswith("xgrammar: ")
        for schema in REFUSED_BY_BOTH:
            with pytest.raises(GrammarError) as exc:
                engines.compile(_spec(schema))
            assert "xgrammar: " in exc.value.message and "llguidance: " in exc.value.message
    engines = _Engines(info)
    assert engines.compile(_spec(BOTH[0][0], backend="llguidance")).backend == "llguidance"
    with pytest.raises(GrammarError, match="unsupported"):
        engines.compile(_spec(LLGUIDANCE_ONLY[0][0], backend="xgrammar"))
    with pytest.raises(GrammarError, match="unknown grammar backend"):
        engines.compile(_spec(BOTH[0][0], backend="outlines"))
    # Regex and Lark never fall through: a syntax error is the caller's to fix.
    with pytest.raises(GrammarError) as exc:
        engines.compile(GrammarSpec(GrammarKind.REGEX, "(unclosed"))
    assert "llguidance" not in exc.value.message
    assert engines.compile(GrammarSpec(GrammarKind.REGEX, "[a-z]+/x", backend="llguidance")).backend == "llguidance"


def test_lie_detector_fixed_sample(bpe_dir: Path) -> None:
    """Labelled instances through bench.coverage's checker: llguidance-selected schemas never accept an invalid one."""
    checker = Checker(str(bpe_dir), "auto", strict=False)
    tally = Tally()
    for i, (schema, valid, invalid) in enumerate(LLGUIDANCE_ONLY):
        tests = [(v, True) for v in valid] + [(v, False) for v in invalid]
        run_case(checker, Case("handwritten", f"h{i}", schema, tests), tally, verbose=False)
    for schema in REFUSED_BY_BOTH:
        run_case(checker, Case("refused", "r", schema, [(1, True)]), tally, verbose=False)
    res = tally.result()
    assert res["crashes"] == 0 and res["invalid_accepted"] == 0, tally.lies
    assert res["accepted"] == len(LLGUIDANCE_ONLY) and res["refused"] == len(REFUSED_BY_BOTH)
    # Not strict, the first (an allOf of two open objects) is merged by exact_rewrites and
    # served on xgrammar; strict mode leaves it to llguidance (test_selection_is_deterministic).
    assert res["accepted_by"] == {"llguidance": len(LLGUIDANCE_ONLY) - 1, "xgrammar": 1}
    assert res["valid_accepted"] == res["valid_instances"]  # these grammars are exact, not stricter


@pytest.mark.shared_data
def test_lie_detector_test_suite_sample(shared_data: Path, bpe_dir: Path) -> None:
    """A fixed sample of JSON-Schema-Test-Suite features where the engines differ."""
    from bench.coverage import test_suite_cases

    suite = require(shared_data, "json-schema-test-suite", "draft2020-12")
    features = ["allOf", "anyOf", "oneOf", "multipleOf", "anchor", "properties", "pattern", "ref"]
    checker = Checker(str(bpe_dir), "auto", strict=False)
    tally = Tally()
    for case in test_suite_cases(suite, features):
        run_case(checker, case, tally, verbose=False)
    res = tally.result()
    assert res["crashes"] == 0 and res["invalid_accepted"] == 0, tally.lies
    assert res["accepted_by"].get("llguidance", 0) >= 10, res["accepted_by"]


def _compiled_on(address: str, bpe_id: str, spec: GrammarSpec, budget_s: float = 120.0) -> None:
    """ValidateGrammar, retried while the replica answers RESOURCE_EXHAUSTED ("still compiling,
    retry shortly": a fresh replica's compile workers are still importing on a loaded box)."""
    deadline = time.monotonic() + budget_s
    with MaskServiceClient(address, deadline_s=30.0) as c:
        while True:
            try:
                c.validate_grammar(bpe_id, spec)
                return
            except MaskServiceError as exc:
                if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def test_replay_after_replica_loss(bpe_dir: Path, registry: TokenizerRegistry, bpe_id: str, hf_tok: Any) -> None:
    """An llguidance session whose replica dies is reopened on the other and replayed: same rows."""
    spec = _spec(LLGUIDANCE_ONLY[0][0])
    tokens = hf_tok.encode('{"a":12,"b":"alpha"}', add_special_tokens=False)
    handles = [build_service(make_config(bpe_dir), registry) for _ in range(2)]
    for h in handles:
        h.server.start()
    addresses = [f"127.0.0.1:{h.port}" for h in handles]
    router = MaskRouter(addresses, deadline_s=10.0, max_retries=0)
    try:
        for address in addresses:  # first compile on a fresh replica starts its compile workers
            _compiled_on(address, bpe_id, spec)
        with MaskServiceClient(addresses[1]) as c:
            info = c.open_session_info(bpe_id, spec)
            assert info.backend == "llguidance"
            p = 4
            expected = c.draft_masks(
                [DraftMaskItem(info.session_id, tokens[p : p + 3], commit_tokens=tokens[:p], commit_seq=1)]
            )[0]
            c.close_session(info.session_id)
        sid = router.open_session(bpe_id, spec)
        assert router.commit(sid, 1, tokens[:2]) is False
        router.draft_masks([DraftMaskItem(sid, tokens[2:4])])
        victim = next(i for i, a in enumerate(addresses) if router._sessions[sid].address == a)
        handles[victim].stop(grace_s=0)
        res = router.draft_masks([DraftMaskItem(sid, tokens[p : p + 3], commit_tokens=tokens[2:p], commit_seq=2)])[0]
        assert router._sessions[sid].address != addresses[victim]
        assert res.num_grammar_accepted == expected.num_grammar_accepted == 3
        np.testing.assert_array_equal(res.bitmask.numpy(), expected.bitmask.numpy())
        router.close_session(sid)
    finally:
        router.close()
        for h in handles:
            h.stop(grace_s=0)


def test_service_reports_backend(service: Any, client: MaskServiceClient, bpe_id: str) -> None:
    for spec, expected in [(_spec(BOTH[0][0]), "xgrammar"), (_spec(LLGUIDANCE_ONLY[1][0]), "llguidance")]:
        _compiled_on(f"127.0.0.1:{service.port}", bpe_id, spec)
        info = client.open_session_info(bpe_id, spec)
        assert info.backend == expected
        client.close_session(info.session_id)
    assert "auto" in BACKENDS
