"""What `--target` / `--draft` name -> local model directories, checked before anything starts.

A flag value is an existing directory (used as is) or a registered model name
(fetched/built into the cache on first use). A target named by the registry
brings its default draft when ``--draft`` is left out; ``--draft none`` runs
without a draft model. A draft whose tokenizer differs from the target's is
refused here, before any process is started.
"""

from __future__ import annotations

import json
from pathlib import Path

from specmask.gpu_worker.models.errors import ModelError
from specmask.gpu_worker.models.registry import DEFAULT_DRAFTS, DEFAULT_MODEL, DISTILLED_DRAFTS, resolve_model

NO_DRAFT = "none"


def resolve_pair(target: str | None, draft: str | None, *, progress: bool = True) -> tuple[str, str | None]:
    """(target_dir, draft_dir or None). ``target`` None = the default real model."""
    target = DEFAULT_MODEL if target is None else target
    if draft is None:
        draft = default_draft(target)
    target_dir = resolve_model(target, progress=progress)
    assert target_dir is not None
    draft_dir = None if draft in (None, NO_DRAFT) else resolve_model(draft, progress=progress)
    if draft_dir is not None:
        check_same_tokenizer(target_dir, draft_dir)
    return target_dir, draft_dir


def default_draft(target: str) -> str | None:
    """The draft a registered ``target`` gets when none is named: its distilled draft when that is
    already built and verified in the cache (never built here: that takes minutes), else the
    registry's default (None = grammar-forced + n-gram drafts)."""
    from specmask.gpu_worker.models.cache import cached_model

    distilled = DISTILLED_DRAFTS.get(target)
    if distilled is not None and cached_model(distilled) is not None:
        return distilled
    return DEFAULT_DRAFTS.get(target)


def draft_hint(target: str | None, draft_dir: str | None) -> str | None:
    """One line telling how to get the distilled draft, when ``target`` has one and runs without it."""
    target = DEFAULT_MODEL if target is None else target
    distilled = DISTILLED_DRAFTS.get(target)
    if draft_dir is not None or distilled is None:
        return None
    return (
        f"a distilled draft model for {target} is not built; `specmask models distill {target}` "
        f"builds it (~20 min on 2 CPU cores) and it is then used by default"
    )


def _vocab(model_dir: str) -> dict[str, int] | None:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def check_same_tokenizer(target_dir: str, draft_dir: str) -> None:
    """Draft tokens are fed to the target as ids: the vocabularies must be the same mapping."""
    draft_vocab = _vocab(draft_dir)
    if draft_vocab is None:
        return  # a draft dir without tokenizer files is taken to share the target's (gpu_worker.actor)
    target_vocab = _vocab(target_dir)
    if target_vocab is None or target_vocab != draft_vocab:
        differing = len(set((target_vocab or {}).items()) ^ set(draft_vocab.items()))
        raise ModelError(
            f"draft {draft_dir} and target {target_dir} use different tokenizers ({differing} differing entries); "
            "a draft must share the target's vocabulary"
        )


def describe(model_dir: str) -> str:
    """One line for logs and the demo: name, layers, width, vocab."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return model_dir
    return (
        f"{model_dir} ({config.get('model_type')}, {config.get('num_hidden_layers')} layers, "
        f"d={config.get('hidden_size')}, vocab {config.get('vocab_size')})"
    )


def resolve_cli_models(
    target: str | None, draft: str | None, *, toy: bool, progress: bool = True
) -> tuple[str, str | None]:
    """`up` / `demo` / `bench.e2e` flags -> dirs: ``toy`` = the toy pair (built on first use; its
    draft unless ``draft`` names another), else ``resolve_pair``."""
    if toy:
        if target is not None:
            raise ModelError("--toy and --target exclude each other")
        from specmask.gpu_worker.toy.build import DEFAULT_OUT_DIR, build_toy_models

        built = build_toy_models(DEFAULT_OUT_DIR, progress=progress)
        toy_target = str(built.target_dir)
        if draft is None:
            return toy_target, str(built.draft_dir)
        return resolve_pair(toy_target, draft, progress=progress)
    return resolve_pair(target, draft, progress=progress)
