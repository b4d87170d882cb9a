"""Toy target/draft pair: schemas, corpus, tokenizer, deterministic cached build, HF loading."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specmask.gpu_worker.toy import build as toy_build  # noqa: E402
from specmask.gpu_worker.toy.build import ToyBuildConfig, build_toy_models  # noqa: E402
from specmask.gpu_worker.toy.corpus import JSON_SEPARATORS, generate_examples  # noqa: E402
from specmask.gpu_worker.toy.schemas import (  # noqa: E402
    HELDOUT_SCHEMAS,
    TRAIN_SCHEMAS,
    all_schemas,
    prompt_for,
    property_names,
    schema_json,
)
from tests.fixtures.tiny_models import build_tiny_model_pair  # noqa: E402

JSON_SAMPLES = [
    '{"id":1,"name":"Alice Smith","tags":["sale","new"],"price":12.5,"active":true,"x":null}',
    '{"name":"Müller","city":"東京","emoji":"🙂","esc":"a\\"b\\\\c\\n\\u0000"}',
    '[{"a":[]},{}]',
    '  { "spaced" : [ 1 , -2.5e-3 ] }\n',
]


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    torch.set_num_threads(1)
    return build_toy_models(tmp_path_factory.mktemp("toy") / "out", ToyBuildConfig.tiny(), progress=False)


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


# --- schemas and corpus -----------------------------------------------------------------


def test_schema_sets_sizes_and_heldout_keys_unseen():
    assert len(TRAIN_SCHEMAS) >= 12 and len(HELDOUT_SCHEMAS) >= 6
    assert not set(TRAIN_SCHEMAS) & set(HELDOUT_SCHEMAS)
    train_keys = set().union(*(property_names(s) for s in TRAIN_SCHEMAS.values()))
    heldout_keys = set().union(*(property_names(s) for s in HELDOUT_SCHEMAS.values()))
    assert not train_keys & heldout_keys, train_keys & heldout_keys
    assert prompt_for("user", TRAIN_SCHEMAS["user"]) == "Generate JSON for schema user:\n"


def test_corpus_is_deterministic_compact_and_valid():
    jsonschema = pytest.importorskip("jsonschema")
    schemas = all_schemas()
    examples = generate_examples(schemas, 600, seed=7)
    assert examples == generate_examples(schemas, 600, seed=7)
    assert examples != generate_examples(schemas, 600, seed=8)
    assert {e.schema_name for e in examples} == set(schemas)
    for e in examples:
        obj = json.loads(e.document)
        jsonschema.validate(obj, schemas[e.schema_name])
        assert e.document == json.dumps(obj, separators=JSON_SEPARATORS, ensure_ascii=False)
        assert e.prompt == prompt_for(e.schema_name, schemas[e.schema_name])


def test_schemas_compile_with_xgrammar_and_accept_corpus_docs(tiny_build):
    xgr = pytest.importorskip("xgrammar")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_build.target_dir)
    info = xgr.TokenizerInfo.from_huggingface(tok)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert info.stop_token_ids == [tok.eos_token_id]
    compiler = xgr.GrammarCompiler(info)
    schemas = all_schemas()
    by_schema: dict[str, list[str]] = {}
    for e in generate_examples(schemas, 400, seed=3):
        by_schema.setdefault(e.schema_name, []).append(e.document)
    for name, schema in schemas.items():
        grammar = compiler.compile_json_schema(schema_json(schema), any_whitespace=False, separators=JSON_SEPARATORS)
        for doc in by_schema[name][:3]:
            # Each document, tokenised as the model emits it, is a grammar path ending in EOS.
            matcher = xgr.GrammarMatcher(grammar)
            accepted = [matcher.accept_token(t) for t in tok.encode(doc)]
            assert all(accepted), (name, doc)
            stop_accepted = matcher.accept_token(tok.eos_token_id)
            assert stop_accepted and matcher.is_terminated(), (name, doc)


# --- tokenizer and HF loading ----------------------------------------------------------


def test_tokenizer_round_trips_any_json(tiny_build):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_build.target_dir)
    assert tok.eos_token == "<|eos|>" and tok.eos_token_id == 0
    assert tok.bos_token is None
    for text in JSON_SAMPLES:
        ids = tok.encode(text)
        assert tok.eos_token_id not in ids  # no special tokens added on encode
        assert tok.decode(ids) == text
    # JSON punctuation is merged, not spelled byte by byte.
    assert len(tok.encode('{"name":"x"}')) < len('{"name":"x"}')


def test_pair_loads_like_real_models(tiny_build):
    target_dir, draft_dir = tiny_build.target_dir, tiny_build.draft_dir
    assert (target_dir / "tokenizer.json").read_bytes() == (draft_dir / "tokenizer.json").read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(draft_dir)
    ids = torch.tensor([tok.encode(prompt_for("user") + '{"id":')])
    vocab = tiny_build.manifest["metrics"]["vocab_size"]
    for d in (target_dir, draft_dir):
        model = transformers.AutoModelForCausalLM.from_pretrained(d)
        assert model.config.model_type == "llama"
        assert model.config.eos_token_id == tok.eos_token_id
        assert model.config.max_position_embeddings == 512
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        assert logits.shape == (1, ids.shape[1], vocab) and torch.isfinite(logits).all()
    assert len(tok) == vocab


# --- build: determinism and cache ------------------------------------------------------


def test_build_is_deterministic(tiny_build, tmp_path):
    torch.set_num_threads(1)
    again = build_toy_models(tmp_path / "again", ToyBuildConfig.tiny(), progress=False)
    assert again.rebuilt
    for sub in ("target", "draft"):
        a, b = _state(tiny_build.out_dir / sub), _state(again.out_dir / sub)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (sub, k)
        assert (tiny_build.out_dir / sub / "tokenizer.json").read_bytes() == (
            again.out_dir / sub / "tokenizer.json"
        ).read_bytes()
    assert tiny_build.manifest["metrics"] == again.manifest["metrics"]


def test_cache_hit_does_not_retrain_and_rebuilds_when_stale(tiny_build, monkeypatch):
    out = tiny_build.out_dir
    config = ToyBuildConfig.tiny()

    def no_training(*args, **kwargs):
        raise AssertionError("cache hit must not retrain")

    with monkeypatch.context() as m:
        m.setattr(toy_build, "_train_into", no_training)
        hit = build_toy_models(out, config, progress=False)
        assert not hit.rebuilt and hit.manifest == tiny_build.manifest
        # Recipe changed -> rebuild (here: the stubbed trainer is reached).
        with pytest.raises(AssertionError, match="must not retrain"):
            build_toy_models(out, ToyBuildConfig.tiny(seed=1), progress=False)
    # The failed rebuild above left the old build intact and still cached.
    assert toy_build.cached_manifest(out, config) is not None
    # A missing file -> rebuild.
    weights = out / "draft" / "model.safetensors"
    weights.unlink()
    assert toy_build.cached_manifest(out, config) is None
    rebuilt = build_toy_models(out, config, progress=False)
    assert rebuilt.rebuilt and weights.is_file()
    assert toy_build.cached_manifest(out, config) is not None


def test_cli_parses_and_dispatches(monkeypatch, tmp_path, capsys):
    from specmask.orchestrator import cli

    calls = []

    def fake_build(out_dir, config, **kwargs):
        calls.append((Path(out_dir), config, kwargs))
        manifest = {
            "build_seconds": 0.0,
            "metrics": {"acceptance_train_distribution": {}, "acceptance_heldout_schemas": {}},
        }
        return toy_build.BuildResult(
            Path(out_dir), Path(out_dir) / "target", Path(out_dir) / "draft", rebuilt=False, manifest=manifest
        )

    monkeypatch.setattr(toy_build, "build_toy_models", fake_build)
    assert cli.main(["toy-models", "build", "--out", str(tmp_path), "--seed", "3", "--force", "--quiet"]) == 0
    ((out, config, kwargs),) = calls
    assert out == tmp_path and config == ToyBuildConfig(seed=3)
    assert kwargs["force"] and not kwargs["progress"]
    assert "cached" in capsys.readouterr().out
    cli.main(["toy-models", "build"])
    assert calls[-1][0] == Path(".specmask") / "toy-models"


# --- the shared tiny-model fixture -----------------------------------------------------


def test_tiny_model_pair_fixture(tmp_path):
    xgr = pytest.importorskip("xgrammar")
    target_dir, draft_dir = build_tiny_model_pair(tmp_path / "a", seed=0)
    tok = transformers.AutoTokenizer.from_pretrained(target_dir)
    assert tok.decode(tok.encode(JSON_SAMPLES[1])) == JSON_SAMPLES[1]
    info = xgr.TokenizerInfo.from_huggingface(tok)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.stop_token_ids == [tok.eos_token_id]
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir)
    draft = transformers.AutoModelForCausalLM.from_pretrained(draft_dir)
    assert target.config.vocab_size == draft.config.vocab_size == len(tok)
    assert target.config.num_hidden_layers > draft.config.num_hidden_layers
    # Same seed -> same weights; padded model vocab is supported.
    again, _ = build_tiny_model_pair(tmp_path / "b", seed=0, vocab_size=len(tok) + 20)
    padded = transformers.AutoModelForCausalLM.from_pretrained(again)
    assert padded.config.vocab_size == len(tok) + 20
    repeat, _ = build_tiny_model_pair(tmp_path / "c", seed=0)
    a, b = target.state_dict(), _state(repeat)
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- full size -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("SPECMASK_SLOW_TESTS"), reason="full toy build (~2 min); set SPECMASK_SLOW_TESTS=1"
)
def test_full_build_meets_acceptance_and_time(tmp_path):
    start = time.perf_counter()
    result = build_toy_models(tmp_path / "full", progress=False)
    elapsed = time.perf_counter() - start
    metrics = result.manifest["metrics"]
    assert elapsed < 300, elapsed
    assert 500 <= metrics["vocab_size"] <= 1000
    assert metrics["acceptance_train_distribution"]["greedy_agreement"] > 0.7
    assert metrics["acceptance_train_distribution"]["alpha"] > 0.6
