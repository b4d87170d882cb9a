"""Real tokenizers and real schemas from ../shared/data (skipped when absent)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import xgrammar as xgr
from mask_reference import reference_walk

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceClient, MaskServiceError
from specmask.mask_service.grammar.backends import XGrammarBackend
from specmask.mask_service.server.server import build_service
from specmask.mask_service.server.tokenizers import TokenizerRegistry, TokenizerSource
from tests.fixtures.shared_data import require
from tests.mask_service.service_config import make_config

pytestmark = [pytest.mark.shared_data, pytest.mark.slow]


def test_stop_tokens_from_config(shared_data) -> None:
    reg = TokenizerRegistry([TokenizerSource.parse(str(require(shared_data, "tokenizers", "qwen3")) + ":151936")])
    [tid] = reg.ids()
    tok = reg.get(tid)
    assert 151645 in tok.stop_token_ids and 128247 not in tok.stop_token_ids
    assert reg.info(tid, None).vocab_size == 151936


def test_llama3_maskbench_rows_exact(shared_data) -> None:
    from transformers import PreTrainedTokenizerFast

    tok_dir = require(shared_data, "tokenizers", "llama3")
    reg = TokenizerRegistry([TokenizerSource(str(tok_dir))])
    tid = tokenizer_id_for_path(tok_dir)
    assert set(reg.get(tid).stop_token_ids) == {128001, 128009}
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    handle = build_service(make_config(tok_dir), reg)
    handle.server.start()
    client = MaskServiceClient(f"127.0.0.1:{handle.port}", deadline_s=60.0)
    compiler = xgr.GrammarCompiler(reg.info(tid, None))
    rng = random.Random(0)
    files = sorted(require(shared_data, "maskbench").glob("Github_easy*.json"))[:40]
    checked = refused = 0
    try:
        for f in files:
            data = json.loads(f.read_text())
            inst = [t["data"] for t in data.get("tests", []) if t.get("valid")]
            if not inst:
                continue
            # The reference walk is xgrammar's, so pin the service to it (schemas only
            # llguidance enforces are refused here; test_llguidance_backend covers those rows).
            spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(data["schema"]), backend="xgrammar")
            try:
                sid = client.open_session(tid, spec)
            except MaskServiceError as exc:
                assert exc.message
                refused += 1
                continue
            compiled = XGrammarBackend().compile(compiler, spec)  # the service's path (schema_rewrite)
            toks = hf.encode(json.dumps(inst[0], separators=(",", ":")), add_special_tokens=False) + [128009]
            probe = xgr.GrammarMatcher(compiled)
            if not all(probe.accept_token(t) for t in toks):
                client.close_session(sid)
                continue  # grammar stricter than the schema (strict mode / key order): not a mask question
            items = []
            for p in sorted(rng.sample(range(len(toks)), min(4, len(toks)))):
                drafts = list(toks[p : p + 4])
                if drafts and rng.random() < 0.3:
                    drafts[rng.randrange(len(drafts))] = rng.randrange(128256)
                items.append((p, drafts))
            for p, drafts in items:
                s2 = client.open_session(tid, spec)
                res = client.draft_masks([DraftMaskItem(s2, drafts, commit_tokens=toks[:p], commit_seq=1)])[0]
                ref, acc, _ = reference_walk(compiled, toks[:p], drafts, 128256)
                np.testing.assert_array_equal(res.bitmask.numpy(), ref)
                assert res.num_grammar_accepted == acc
                client.close_session(s2)
                checked += 1
            client.close_session(sid)
    finally:
        client.close()
        handle.stop(grace_s=0)
    assert checked >= 40, (checked, refused)
