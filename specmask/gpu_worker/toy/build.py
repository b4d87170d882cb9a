"""Build (or reuse) the toy target/draft pair: corpus -> tokenizer -> target -> draft.

Layout of the output dir:
    <out>/target/   HF Llama dir (config, safetensors, tokenizer files)
    <out>/draft/    HF Llama dir, same tokenizer files
    <out>/manifest.json   recipe hash, config, file sizes, metrics, build time
The build is reused when manifest.json exists, its recipe hash equals the
current one (config + source of the toy package), and every listed file is
present with its recorded size; otherwise it is rebuilt from scratch.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specmask.gpu_worker.toy import corpus, schemas, tokenizer, train, values
from specmask.gpu_worker.toy.train import ModelShape

logger = logging.getLogger(__name__)

DEFAULT_OUT_DIR = Path(".specmask") / "toy-models"
LOCK_NAME = ".build.lock"
MANIFEST_NAME = "manifest.json"
# Bump when the on-disk layout changes in a way the recipe hash cannot see.
BUILD_FORMAT_VERSION = 1
# Modules whose source is part of the recipe: editing any of them rebuilds.
_RECIPE_MODULES = (corpus, schemas, tokenizer, train, values)

TARGET_SHAPE = ModelShape(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2)
DRAFT_SHAPE = ModelShape(hidden_size=64, intermediate_size=192, num_layers=1, num_heads=2, num_kv_heads=1)


@dataclass(frozen=True)
class ToyBuildConfig:
    seed: int = 0
    vocab_size: int = 768  # BPE size incl. EOS and the 256 byte tokens
    num_train_docs: int = 12_800  # one epoch of target training at 400 x 32
    num_eval_docs: int = 256  # per split (train-distribution, held-out schemas)
    max_position_embeddings: int = 512
    # Sized to train on a 2-core box in about a minute (shared/data/README.md).
    target: ModelShape = TARGET_SHAPE
    draft: ModelShape = DRAFT_SHAPE
    target_steps: int = 400
    draft_steps: int = 300  # distillation (each step also runs the target forward); 150 gave alpha 0.62, 300 gives 0.90
    batch_size: int = 32
    target_lr: float = 3e-3
    draft_lr: float = 5e-3

    @classmethod
    def tiny(cls, seed: int = 0) -> ToyBuildConfig:
        """Seconds-long build for tests: same pipeline, toy-of-a-toy sizes."""
        return cls(
            seed=seed,
            vocab_size=320,
            num_train_docs=64,
            num_eval_docs=16,
            max_position_embeddings=512,
            target=ModelShape(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1),
            draft=ModelShape(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=1, num_kv_heads=1),
            target_steps=4,
            draft_steps=3,
            batch_size=8,
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BuildResult:
    out_dir: Path
    target_dir: Path
    draft_dir: Path
    rebuilt: bool  # False: served from the cache
    manifest: dict[str, Any] = field(repr=False)


def recipe_hash(config: ToyBuildConfig) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"format": BUILD_FORMAT_VERSION, "config": config.to_json()}, sort_keys=True).encode())
    for module in _RECIPE_MODULES:
        h.update(Path(str(module.__file__)).read_bytes())  # every recipe module is a .py file
    return h.hexdigest()


def _file_sizes(out_dir: Path) -> dict[str, int]:
    return {
        str(p.relative_to(out_dir)): p.stat().st_size
        for sub in ("target", "draft")
        for p in sorted((out_dir / sub).rglob("*"))
        if p.is_file()
    }


def cached_manifest(out_dir: Path, config: ToyBuildConfig) -> dict[str, Any] | None:
    """The manifest if the build in `out_dir` is complete and matches `config`."""
    try:
        manifest = json.loads((out_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("recipe_hash") != recipe_hash(config):
        return None
    for rel, size in manifest.get("files", {}).items():
        path = out_dir / rel
        if not path.is_file() or path.stat().st_size != size:
            return None
    return manifest if manifest.get("files") else None


def build_toy_models(
    out_dir: str | Path = DEFAULT_OUT_DIR,
    config: ToyBuildConfig = ToyBuildConfig(),
    *,
    force: bool = False,
    progress: bool = True,
    num_threads: int | None = None,
) -> BuildResult:
    """Ensure `out_dir` holds the toy pair for `config`; train it if missing or stale.

    Concurrent callers (the demo, a bench and a test at once) serialise on an
    exclusive lock file: the second waits, then finds the first one's build.
    """
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / LOCK_NAME, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes
        return _build_locked(out_dir, config, force=force, progress=progress, num_threads=num_threads)


def _build_locked(
    out_dir: Path, config: ToyBuildConfig, *, force: bool, progress: bool, num_threads: int | None
) -> BuildResult:
    if not force:
        manifest = cached_manifest(out_dir, config)
        if manifest is not None:
            logger.info("toy models up to date in %s (recipe %s)", out_dir, manifest["recipe_hash"][:12])
            return BuildResult(out_dir, out_dir / "target", out_dir / "draft", rebuilt=False, manifest=manifest)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    started = time.perf_counter()
    staging = out_dir / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    metrics, timings = _train_into(staging, config, progress=progress)
    # Swap the finished dirs in; manifest last, so a crash leaves no valid manifest.
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for sub in ("target", "draft"):
        shutil.rmtree(out_dir / sub, ignore_errors=True)
        (staging / sub).rename(out_dir / sub)
    shutil.rmtree(staging, ignore_errors=True)
    manifest = {
        "recipe_hash": recipe_hash(config),
        "config": config.to_json(),
        "files": _file_sizes(out_dir),
        "metrics": metrics,
        "build_seconds": round(time.perf_counter() - started, 2),
        "timings": timings,
        "torch_threads": torch.get_num_threads(),
    }
    (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    logger.info("built toy models in %s in %.1f s", out_dir, manifest["build_seconds"])
    return BuildResult(out_dir, out_dir / "target", out_dir / "draft", rebuilt=True, manifest=manifest)


def _train_into(staging: Path, config: ToyBuildConfig, *, progress: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Train and save into `staging`; returns (metrics, timings). Metrics are
    reproducible (same config -> same numbers); timings are not."""
    from tqdm.auto import tqdm

    seed = config.seed
    train_examples = corpus.generate_examples(schemas.TRAIN_SCHEMAS, config.num_train_docs, seed)
    # Disjoint seeds: eval documents are fresh draws, not training documents.
    eval_train = corpus.generate_examples(schemas.TRAIN_SCHEMAS, config.num_eval_docs, seed + 1_000_003)
    eval_heldout = corpus.generate_examples(schemas.HELDOUT_SCHEMAS, config.num_eval_docs, seed + 2_000_003)

    # Held-out texts are deliberately not in the tokenizer corpus either.
    bpe = tokenizer.train_bpe((e.prompt + e.document for e in train_examples), config.vocab_size)
    eos_id = bpe.token_to_id(tokenizer.EOS_TOKEN)
    assert eos_id is not None  # train_bpe adds it as a special token
    vocab_size = bpe.get_vocab_size()
    max_len = config.max_position_embeddings
    data = train.encode(bpe, train_examples, eos_id, max_len)
    ev_train = train.encode(bpe, eval_train, eos_id, max_len)
    ev_heldout = train.encode(bpe, eval_heldout, eos_id, max_len)

    bar = tqdm(total=config.target_steps + config.draft_steps, desc="toy-models", unit="step", disable=not progress)

    def tick(phase: str):
        def on_step(loss: float) -> None:
            bar.set_postfix_str(f"{phase} loss={loss:.3f}", refresh=False)
            bar.update(1)

        return on_step

    batch_size = config.batch_size
    t0 = time.perf_counter()
    target = train.init_model(config.target, vocab_size, eos_id, max_len, seed)
    target_loss = train.train(
        target,
        data,
        steps=config.target_steps,
        lr=config.target_lr,
        seed=seed,
        on_step=tick("target"),
        batch_size=batch_size,
        pad_id=eos_id,
    )
    t1 = time.perf_counter()
    draft = train.init_model(config.draft, vocab_size, eos_id, max_len, seed + 1)
    draft_loss = train.train(
        draft,
        data,
        steps=config.draft_steps,
        lr=config.draft_lr,
        seed=seed + 1,
        teacher=target,
        on_step=tick("draft"),
        batch_size=batch_size,
        pad_id=eos_id,
    )
    t2 = time.perf_counter()
    bar.close()

    for sub, model in (("target", target), ("draft", draft)):
        model.save_pretrained(staging / sub)
        tokenizer.save_tokenizer(bpe, staging / sub, model_max_length=max_len)

    metrics = {
        "vocab_size": vocab_size,
        "eos_token_id": eos_id,
        "num_train_examples": len(data),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "target_final_loss": round(target_loss, 4),
        "draft_final_kl": round(draft_loss, 4),
        "acceptance_train_distribution": _rounded(train.acceptance(target, draft, ev_train, pad_id=eos_id)),
        "acceptance_heldout_schemas": _rounded(train.acceptance(target, draft, ev_heldout, pad_id=eos_id)),
    }
    return metrics, {"target_train_seconds": round(t1 - t0, 2), "draft_train_seconds": round(t2 - t1, 2)}


def _rounded(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in d.items()}
