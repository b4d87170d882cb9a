"""Training loops for the toy pair: target by next-token CE, draft by distillation.

Everything is deterministic for a fixed seed and thread count: data order comes
from a seeded torch.Generator, initialisation from torch.manual_seed, and the
models run in float32 on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specmask.gpu_worker.toy.corpus import Example

IGNORE_INDEX = -100
# Linear warm-up then cosine decay to 10%: stable for tiny Llamas at lr ~3e-3.
_WARMUP_FRACTION = 0.05
_MIN_LR_FRACTION = 0.1
# Batches per length-sorting window in batch_order: enough to pad little, few
# enough that each window still mixes schemas.
_BUCKET_BATCHES = 8


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int


@dataclass(frozen=True)
class EncodedExample:
    input_ids: tuple[int, ...]  # [seq_len] prompt + document + EOS
    prompt_len: int  # loss and metrics cover positions >= prompt_len


def llama_config(shape: ModelShape, vocab_size: int, eos_token_id: int, max_position_embeddings: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        torch_dtype="float32",
    )


def init_model(shape: ModelShape, vocab_size: int, eos_token_id: int, max_position_embeddings: int, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = llama_config(shape, vocab_size, eos_token_id, max_position_embeddings)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def encode(tokenizer, examples: Sequence[Example], eos_token_id: int, max_len: int) -> list[EncodedExample]:
    """Tokenise prompt and document separately (as at inference: the prompt is
    tokenised alone, then the model continues), append EOS, drop over-long ones."""
    out = []
    for ex in examples:
        prompt = tokenizer.encode(ex.prompt).ids
        doc = tokenizer.encode(ex.document).ids
        ids = (*prompt, *doc, eos_token_id)
        if len(ids) <= max_len:
            out.append(EncodedExample(input_ids=ids, prompt_len=len(prompt)))
    return out


def collate(batch: Sequence[EncodedExample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids [B, T], attention_mask [B, T], labels [B, T]); labels
    are next-token targets already shifted, IGNORE_INDEX on prompt and padding."""
    seq_len = max(len(e.input_ids) for e in batch)
    input_ids = torch.full((len(batch), seq_len), pad_id, dtype=torch.long)  # [B, T]
    attention = torch.zeros((len(batch), seq_len), dtype=torch.long)  # [B, T]
    labels = torch.full((len(batch), seq_len), IGNORE_INDEX, dtype=torch.long)  # [B, T]
    for i, e in enumerate(batch):
        n = len(e.input_ids)
        ids = torch.tensor(e.input_ids, dtype=torch.long)
        input_ids[i, :n] = ids
        attention[i, :n] = 1
        # Position t predicts token t+1; the first predicted token is the first document token.
        labels[i, e.prompt_len - 1 : n - 1] = ids[e.prompt_len :]
    return input_ids, attention, labels


def batch_order(lengths: Sequence[int], batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """`steps` batches of example indices, deterministic for a seed.

    Each epoch is a seeded permutation; within windows of _BUCKET_BATCHES batches
    examples are sorted by length so a batch pads little (right-padding wastes
    ~40% of the compute on randomly mixed lengths), and the batches are then
    shuffled so training does not see lengths in order."""
    gen = torch.Generator().manual_seed(seed)
    batches: list[list[int]] = []
    window = batch_size * _BUCKET_BATCHES
    while len(batches) < steps:
        perm = torch.randperm(len(lengths), generator=gen).tolist()
        epoch: list[list[int]] = []
        for start in range(0, len(perm) - batch_size + 1, window):
            chunk = sorted(perm[start : start + window], key=lambda i: lengths[i])
            epoch.extend(chunk[j : j + batch_size] for j in range(0, len(chunk) - batch_size + 1, batch_size))
        if not epoch:  # fewer examples than one batch: reuse them
            epoch = [perm[:batch_size]]
        shuffled = torch.randperm(len(epoch), generator=gen).tolist()
        batches.extend(epoch[i] for i in shuffled)
    return batches[:steps]


def _lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, int(steps * _WARMUP_FRACTION))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (_MIN_LR_FRACTION + (1 - _MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    model: torch.nn.Module,
    data: Sequence[EncodedExample],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    pad_id: int,
    teacher: torch.nn.Module | None = None,
    on_step: Callable[[float], None] | None = None,
) -> float:
    """Train `model` for `steps`; with a `teacher`, minimise KL(teacher || model)
    over document positions (distillation), else next-token cross-entropy.
    Returns the mean loss of the last 10% of steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    model.train()
    if teacher is not None:
        teacher.eval()
    losses: list[float] = []
    for step, idx in enumerate(batch_order([len(e.input_ids) for e in data], batch_size, steps, seed)):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr)
        input_ids, attention, labels = collate([data[i] for i in idx], pad_id)
        logits = model(input_ids=input_ids, attention_mask=attention).logits  # [B, T, V]
        valid = labels != IGNORE_INDEX  # [B, T]
        if teacher is None:
            loss = F.cross_entropy(logits[valid], labels[valid])
        else:
            with torch.no_grad():
                teacher_logits = teacher(input_ids=input_ids, attention_mask=attention).logits  # [B, T, V]
            loss = F.kl_div(
                F.log_softmax(logits[valid], dim=-1),
                F.log_softmax(teacher_logits[valid], dim=-1),
                log_target=True,
                reduction="batchmean",
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(losses[-1])
    model.eval()
    tail = losses[-max(1, steps // 10) :]
    return sum(tail) / len(tail)


@torch.no_grad()
def acceptance(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    data: Sequence[EncodedExample],
    *,
    pad_id: int,
    batch_size: int = 32,
) -> dict[str, float]:
    """Grammar-blind draft-vs-target agreement over document positions (incl. EOS):
    `greedy_agreement` = P[argmax q == argmax p], `alpha` = mean Σ_v min(p, q)
    (the per-position rejection-sampling acceptance rate, docs/design.md), and
    `target_accuracy` = P[argmax p == true next token]."""
    target.eval()
    draft.eval()
    agree = alpha = correct = 0.0
    count = 0
    for start in range(0, len(data), batch_size):
        input_ids, attention, labels = collate(data[start : start + batch_size], pad_id)
        valid = labels != IGNORE_INDEX  # [B, T]
        p = target(input_ids=input_ids, attention_mask=attention).logits[valid].softmax(-1)  # [N, V]
        q = draft(input_ids=input_ids, attention_mask=attention).logits[valid].softmax(-1)  # [N, V]
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        alpha += torch.minimum(p, q).sum().item()
        correct += (p.argmax(-1) == labels[valid]).sum().item()
        count += int(valid.sum())
    return {
        "greedy_agreement": agree / count,
        "alpha": alpha / count,
        "target_accuracy": correct / count,
        "positions": float(count),
    }
