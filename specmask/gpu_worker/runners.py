"""The model runners a worker serves with: the target's, and the draft's when one is configured.

``load_runners`` loads each causal LM from its dir, or takes one already built (bench.gpu's
random-initialised models at real shapes; a draft shared with another worker), sets torch's
CPU threads by the target's size, checks that a draft shares the target's vocabulary (draft
tokens are fed to the target as ids) and scores the draft vocabulary, and wraps each model
in a ``ModelRunner``.
"""

from __future__ import annotations

from typing import Any

import torch

from specmask.gpu_worker.config import WorkerConfig
from specmask.gpu_worker.loading import (
    checkpoint_dtype,
    cpu_threads,
    has_tokenizer,
    load_causal_lm,
    load_tokenizer,
    read_draft_vocab,
    resolve_dtype,
    restrict_output_vocab,
)
from specmask.gpu_worker.model_runner import ModelRunner


def load_runners(
    config: WorkerConfig, device: torch.device, tokenizer: Any, *, target_model: Any = None, draft_model: Any = None
) -> tuple[ModelRunner, ModelRunner | None]:
    """The target's runner and the draft's (None without ``config.draft_dir``). ``tokenizer``:
    the target's, which a draft dir's tokenizer must equal."""
    dtype = resolve_dtype(config.dtype, device, checkpoint_dtype(config.target_dir))
    if target_model is None:
        target_model = load_causal_lm(
            config.target_dir, dtype, device, max_model_len=config.max_model_len, name="target"
        )
    threads = cpu_threads(config.torch_threads, device, sum(p.numel() for p in target_model.parameters()))
    if threads is not None:
        torch.set_num_threads(threads)
    target = ModelRunner(
        target_model,
        batched=config.batched_forward,
        name="target",
        static=config.static_forward,
        max_model_len=config.max_model_len,
    )
    if config.draft_dir is None:
        return target, None
    check_shared_tokenizer(config.draft_dir, tokenizer)
    draft_ids = read_draft_vocab(config.draft_dir, target.vocab_size)
    if draft_model is None:
        draft_model = load_causal_lm(config.draft_dir, dtype, device, max_model_len=target.max_model_len, name="draft")
        if draft_ids is not None:
            restrict_output_vocab(draft_model, draft_ids)
    elif draft_ids is not None and draft_model.get_output_embeddings().weight.shape[0] != len(draft_ids):
        # A shared draft is another worker's, its head restricted when that worker loaded it.
        raise ValueError(f"the shared draft model's head does not score the {len(draft_ids)} draft-vocabulary ids")
    draft = ModelRunner(
        draft_model,
        batched=config.batched_forward,
        name="draft",
        static=config.static_forward,
        output_ids=draft_ids,
        max_model_len=target.max_model_len,  # a draft never runs past the target
    )
    return target, draft


def check_shared_tokenizer(draft_dir: str, tokenizer: Any) -> None:
    """Draft tokens are fed to the target as ids: both must use the same vocabulary."""
    if not has_tokenizer(draft_dir):
        return  # a draft dir without tokenizer files is taken to share the target's
    if load_tokenizer(draft_dir).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"draft tokenizer in {draft_dir} differs from the target's")
