"""GGUF file -> plain Hugging Face directory (safetensors, config, tokenizer with chat template).

transformers dequantises a GGUF on load (``from_pretrained(dir, gguf_file=...)``)
but refuses ``save_pretrained`` on the result, so the state dict is copied into
a fresh model of the same config and that one is saved. The architecture is
read from the GGUF header first: an unsupported one fails before the (slow)
dequantisation starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specmask.gpu_worker.models.errors import ModelError

logger = logging.getLogger(__name__)

# GGUF general.architecture -> transformers class name. The worker's runner and
# KV cache are written for decoder-only Llama-style models; extend with care.
SUPPORTED_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM"}


@dataclass(frozen=True)
class ConvertedModel:
    architecture: str
    num_parameters: int
    vocab_size: int
    num_layers: int


def gguf_architecture(gguf_path: Path) -> str:
    """``general.architecture`` from the header; ModelError when the file is not a readable GGUF."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(gguf_path))
        field = reader.get_field("general.architecture")
        if field is None:
            raise ValueError("no general.architecture key")
        return str(field.contents())
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise ModelError(f"{gguf_path.name} is not a readable GGUF file ({exc}); delete it and fetch again") from None


def convert_gguf(gguf_path: Path, out_dir: Path, *, dtype: str = "float32") -> ConvertedModel:
    """Write ``out_dir`` (must not exist yet) as an HF model dir converted from ``gguf_path``."""
    import torch
    import transformers

    arch = gguf_architecture(gguf_path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{gguf_path.name}: GGUF architecture {arch!r} is not supported "
            f"(supported: {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    model_cls = getattr(transformers, SUPPORTED_ARCHITECTURES[arch])
    src_dir, name = str(gguf_path.parent), gguf_path.name
    torch_dtype = getattr(torch, dtype)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch_dtype)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise ModelError(f"transformers could not load {gguf_path.name}: {exc}".splitlines()[0]) from None

    config = loaded.config
    # The GGUF origin is recorded in the manifest, not the config: a config that
    # names a quantisation makes from_pretrained look for the GGUF again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch_dtype
    plain = model_cls(config).to(torch_dtype)
    missing, unexpected = plain.load_state_dict(_state_dict(loaded), strict=False)
    # Tied heads are absent from the GGUF-loaded dict on purpose; anything else is a bug.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelError(
            f"{gguf_path.name}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.eval()
    out_dir.mkdir(parents=True)
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("%s carries no chat template; chat requests will be refused for this model", name)
    return ConvertedModel(
        architecture=arch,
        num_parameters=sum(p.numel() for p in plain.parameters()),
        vocab_size=int(config.vocab_size),
        num_layers=int(config.num_hidden_layers),
    )


def _state_dict(model: Any) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
