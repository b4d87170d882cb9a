"""Models named by a Hugging Face id come from the local Hugging Face cache, offline: a cached
snapshot resolves to its directory; an id that is not cached, or a snapshot without weights or
tokenizer, is a clear ModelError. The cache is laid out by huggingface_hub's own rules
(models--org--name/refs/main -> snapshots/<commit>), read by the real library."""

from __future__ import annotations

from pathlib import Path

import pytest

from specmask.gpu_worker.models import registry
from specmask.gpu_worker.models.errors import ModelError
from specmask.gpu_worker.models.hub import cached_snapshot, looks_like_repo_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_snapshot(cache: Path, repo_id: str, files: dict[str, str]) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def test_cached_id_resolves_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = _cache_snapshot(
        tmp_path, "acme/tiny-chat", {"config.json": "{}", "tokenizer.json": "{}", "model.safetensors": "x"}
    )
    assert cached_snapshot("acme/tiny-chat", cache_dir=tmp_path) == str(snapshot)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert registry.resolve_model("acme/tiny-chat") == str(snapshot)


def test_missing_or_incomplete_ids_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"not in the local Hugging Face cache .*`hf download acme/absent`"):
        cached_snapshot("acme/absent", cache_dir=tmp_path)
    _cache_snapshot(tmp_path, "acme/no-weights", {"config.json": "{}", "tokenizer.json": "{}"})
    with pytest.raises(ModelError, match=r"lacks \*\.safetensors"):
        cached_snapshot("acme/no-weights", cache_dir=tmp_path)


def test_repo_id_shape() -> None:
    assert looks_like_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not looks_like_repo_id("smollm2-135m-instruct")
    assert not looks_like_repo_id("a/b/c") and not looks_like_repo_id("/abs/path")
