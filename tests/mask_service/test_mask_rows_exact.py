"""Every row over gRPC is bit-identical to xgrammar called directly (docs/design.md step 2)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import xgrammar as xgr
from mask_reference import reference_rows, reference_walk

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceClient
from specmask.mask_service.grammar.backends import XGrammarBackend, any_json_ebnf
from specmask.mask_service.server.draft_masks import MIN_ROWS_PER_CHUNK

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "integer"}}, "enabled": {"type": "boolean"}},
        "required": ["items"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
            },
            "required": ["id", "tags"],
        },
    },
    {
        "type": "object",
        "properties": {"price": {"type": "number"}, "title": {"type": "string", "maxLength": 12}},
        "required": ["price", "title"],
    },
    {
        "anyOf": [
            {"type": "integer"},
            {"type": "object", "properties": {"value": {"type": "null"}}, "required": ["value"]},
        ]
    },
]
DOCS = [
    {"name": "alpha beta", "age": 42},
    {"items": [1, 2, 30], "enabled": True},
    [{"id": 7, "tags": ["red", "blue"]}, {"id": 8, "tags": []}],
    {"price": -12.5, "title": "hello world"},
    {"value": None},
]
OTHER = [
    (GrammarSpec(GrammarKind.REGEX, r"[a-z]{2,5}-[0-9]+"), "gamma-123"),
    (
        GrammarSpec(GrammarKind.EBNF, 'root ::= "{" pair ("," pair)* "}"\npair ::= "\\"" [a-z]+ "\\":" [0-9]+'),
        '{"ab":12,"c":3}',
    ),
    (GrammarSpec(GrammarKind.LARK, 'start: "[" NUM ("," NUM)* "]"\nNUM: /[0-9]+/'), "[1,22,333]"),
    (GrammarSpec(GrammarKind.ANY_JSON), '{"x":[1,{"y":null}],"z":"hello"}'),
]


def _compile_direct(registry, bpe_id, spec: GrammarSpec):
    compiler = xgr.GrammarCompiler(registry.info(bpe_id, None))
    if spec.kind is GrammarKind.JSON_SCHEMA:
        # The backend's JSON-schema path (check, rewrite, EBNF repair: schema_rewrite) is
        # what the service compiles; rows must match a matcher over that same grammar.
        return XGrammarBackend().compile(compiler, spec)
    if spec.kind is GrammarKind.REGEX:
        return compiler.compile_regex(spec.text)
    if spec.kind is GrammarKind.EBNF:
        return compiler.compile_grammar(spec.text)
    if spec.kind is GrammarKind.LARK:
        return compiler.compile_grammar(xgr.Grammar.from_lark(spec.text))
    return compiler.compile_grammar(any_json_ebnf(",", ":"))


def _cases() -> list[tuple[GrammarSpec, str]]:
    out = [
        (GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(s)), json.dumps(d, separators=(",", ":")))
        for s, d in zip(SCHEMAS, DOCS)
    ]
    return out + OTHER


@pytest.mark.parametrize("case", range(len(_cases())))
def test_rows_bit_identical(case: int, client: MaskServiceClient, registry, bpe_id, hf_tok) -> None:
    spec, doc = _cases()[case]
    rng = random.Random(case)
    compiled = _compile_direct(registry, bpe_id, spec)
    info = registry.info(bpe_id, None)
    vocab = info.vocab_size
    eos = list(info.stop_token_ids)
    tokens = hf_tok.encode(doc, add_special_tokens=False) + eos[:1]
    sid = client.open_session(bpe_id, spec)
    committed = 0
    seq = 0
    while True:
        advance = rng.randint(1, 3) if seq else 0  # first call commits nothing
        new = tokens[committed : committed + advance]
        base = committed + len(new)
        k = rng.randint(0, 5)
        drafts = list(tokens[base : base + k])
        if drafts and rng.random() < 0.5:
            drafts[rng.randrange(len(drafts))] = rng.randrange(vocab)
        seq += 1
        item = DraftMaskItem(sid, drafts, commit_tokens=new, commit_seq=seq)
        drafts_after = drafts
        [res] = client.draft_masks([item])
        ref, accepted, stopped = reference_walk(compiled, tokens[:base], drafts_after, vocab)
        np.testing.assert_array_equal(res.bitmask.numpy(), ref)
        assert res.num_grammar_accepted == accepted
        # last-row-only: the row after all drafts, or all-ones if the walk stopped first
        [last] = client.draft_masks([DraftMaskItem(sid, drafts_after, last_row_only=True)])
        if not stopped:
            np.testing.assert_array_equal(last.bitmask.numpy()[0], ref[len(drafts_after)])
        else:
            assert np.all(last.bitmask.numpy() == -1)
        committed = base
        if res.terminated or committed >= len(tokens):
            break
    assert res.terminated, "committing the document plus a stop token must terminate the matcher"
    [after] = client.draft_masks([DraftMaskItem(sid, [tokens[0]])])
    assert np.all(after.bitmask.numpy() == -1) and after.num_grammar_accepted == 0 and after.terminated
    client.close_session(sid)


def test_batch_mixed_sessions_match_singles(client: MaskServiceClient, registry, bpe_id, hf_tok) -> None:
    """One batched call equals per-request references, in request order, with k = 0 mixed in."""
    rng = random.Random(7)
    items, refs = [], []
    vocab = registry.info(bpe_id, None).vocab_size
    for spec, doc in _cases() * 3:
        compiled = _compile_direct(registry, bpe_id, spec)
        toks = hf_tok.encode(doc, add_special_tokens=False)
        sid = client.open_session(bpe_id, spec)
        p = rng.randrange(len(toks))
        k = rng.choice([0, 1, 4])
        drafts = list(toks[p : p + k])
        if drafts and rng.random() < 0.3:
            drafts[-1] = rng.randrange(vocab)
        items.append(DraftMaskItem(sid, drafts, commit_tokens=toks[:p], commit_seq=1))
        refs.append(reference_rows(compiled, toks[:p], drafts, vocab))
    # Enough rows that the call is split over the service's two mask threads (draft_masks.run).
    assert sum(len(it.draft_tokens) + 1 for it in items) >= 2 * MIN_ROWS_PER_CHUNK
    results = client.draft_masks(items)
    for res, (ref, acc) in zip(results, refs):
        np.testing.assert_array_equal(res.bitmask.numpy(), ref)
        assert res.num_grammar_accepted == acc
    for it in items:
        client.close_session(it.session_id)
