"""Load models and tokenizers from local HuggingFace directories (never the hub)."""

from __future__ import annotations

import itertools
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """ "auto" -> cuda when present, else cpu. Called at load time, never at import."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# Below this many target parameters a CPU worker keeps one torch thread. Per-op work is then
# too small to split, and OpenMP's second thread spin-waits between regions: with the tiny
# test pair at 2 threads the worker nearly doubled its CPU use for no faster step, taking
# the cores the mask service and orchestrator share. A real model (SmolLM2-135M) gains from
# the second thread (docs/benchmarks.md, "End to end, SmolLM2 speed").
MIN_PARAMS_FOR_THREADS = 20_000_000


def cpu_threads(requested: int | None, device: torch.device, num_params: int) -> int | None:
    """torch intra-op threads for WorkerConfig.torch_threads. None = leave the process's setting;
    0 = every CPU this process may run on, when ``device`` is the CPU and the model (of
    ``num_params`` parameters) is large enough to use them (else 1); a GPU worker is left alone."""
    if requested != 0:
        return requested
    if device.type != "cpu":
        return None
    if num_params < MIN_PARAMS_FOR_THREADS:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# WorkerConfig.dtype / --dtype: the checkpoint's dtype on a GPU, float32 elsewhere.
AUTO_DTYPE = "auto"


def checkpoint_dtype(path: str) -> str | None:
    """The dtype a checkpoint's config.json records (``dtype``, formerly ``torch_dtype``; a
    multimodal config's ``text_config`` when the top level has none), or None."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    config = json.loads(file.read_text())
    for level in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = level.get(key)
            if isinstance(value, str):
                return value.removeprefix("torch.")
    return None


def resolve_dtype(name: str, device: torch.device | str = "cpu", checkpoint: str | None = None) -> torch.dtype:
    """The torch dtype ``name`` means for models loaded on ``device``.

    "auto": on CUDA the checkpoint's own dtype (``checkpoint``, from ``checkpoint_dtype``;
    bfloat16 for Llama 3, Qwen2.5/3, Mistral), float32 when it records none or a
    non-floating one; on any other device float32, which keeps greedy decoding exact and
    is what CPU kernels are fast at. Any other name must be a torch floating dtype."""
    if name == AUTO_DTYPE:
        if torch.device(device).type != "cuda" or checkpoint is None:
            return torch.float32
        recorded = getattr(torch, checkpoint, None)
        ok = isinstance(recorded, torch.dtype) and recorded.is_floating_point
        return recorded if ok and isinstance(recorded, torch.dtype) else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be auto or a torch floating dtype (float32, bfloat16, ...), got {name!r}")
    return dtype


def load_causal_lm(
    path: str, dtype: torch.dtype, device: torch.device, *, max_model_len: int | None = None, name: str = "model"
) -> Any:
    """AutoModelForCausalLM from a local dir, in eval mode on ``device``. A configuration the
    worker does not implement (gpu_worker.architecture; its sequences capped at ``max_model_len``)
    raises ``UnsupportedModel`` before any weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not Path(path).is_dir():
        raise FileNotFoundError(f"model dir does not exist: {path}")
    from specmask.gpu_worker.architecture import check
    from specmask.gpu_worker.attention import register

    check(AutoConfig.from_pretrained(path, local_files_only=True), max_model_len, name=name)

    # SDPA with native grouped-query attention under the runner's masks (specmask/gpu_worker/attention.py).
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, attn_implementation=register()
    )
    model.to(device)  # type: ignore[arg-type]  # transformers types .to() through a decorator that hides self
    model.eval()
    return model


# A draft directory may name the target-vocabulary ids its LM head scores (a JSON list, sorted,
# distinct): a draft trained to propose only the tokens structured output uses needs only those
# rows of the projection, which is most of a small draft's per-token cost (SmolLM2: 28 M of the
# 35 M parameters a two-layer draft reads per token). Written by `specmask models distill`.
DRAFT_VOCAB_FILE = "draft_vocab.json"


def read_draft_vocab(path: str, vocab_size: int) -> torch.Tensor | None:
    """The ids in ``path``/DRAFT_VOCAB_FILE as an int64 tensor, or None when the file is absent.
    Raises ValueError on a list that is empty, unsorted, repeated or outside ``[0, vocab_size)``."""
    file = Path(path) / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    ids = json.loads(file.read_text())
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        or any(b <= a for a, b in itertools.pairwise(ids))
        or ids[0] < 0
        or ids[-1] >= vocab_size
    ):
        raise ValueError(f"{file}: expected a sorted list of distinct token ids in [0, {vocab_size})")
    return torch.tensor(ids, dtype=torch.long)


def restrict_output_vocab(model: Any, ids: torch.Tensor) -> None:
    """Replace ``model``'s LM head by one scoring only ``ids`` (its rows of the full head): logit
    column j is then token ``ids[j]``. The input embedding is untouched (a tied head is untied)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("a draft vocabulary needs an LM head without bias")
    weight = head.weight.detach()[ids.to(head.weight.device)].clone()  # [n, hidden]
    small = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    small.weight = torch.nn.Parameter(weight, requires_grad=False)
    model.set_output_embeddings(small)
    model.config.tie_word_embeddings = False  # a later tie_weights() must not undo this


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def has_tokenizer(path: str) -> bool:
    return (Path(path) / "tokenizer.json").is_file() or (Path(path) / "tokenizer.model").is_file()


def eos_token_ids(path: str, tokenizer: Any) -> tuple[int, ...]:
    """The default stop set: the tokenizer's EOS plus generation_config.json's eos_token_id(s)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(x) for x in eos)
    return tuple(sorted(ids))
