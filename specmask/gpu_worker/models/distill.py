"""A small draft for a registered target, distilled here from the target's own constrained outputs.

Pipeline (all on the CPU, seeded, float32):

1. **Prompts.** ``distill_schemas.random_schemas`` draws JSON Schemas; each
   becomes a chat prompt the way the server builds one (the schema instruction
   in the system turn, the benchmark's user turn, the target's chat template).
2. **Teacher data.** The target decodes each prompt greedily under the schema's
   grammar (xgrammar, compiled as the mask service compiles JSON Schemas), in
   left-padded batches with a KV cache. At every output position the grammar
   mask is applied to the target's logits before anything is recorded, so what
   the draft learns is the *constrained* distribution: the top-k of the masked
   target distribution, the packed mask itself, and whether the position was
   grammar-forced (one allowed token: the worker drafts those without a forward,
   so they carry no loss).
3. **Student.** A Llama with ``layers`` of the target's decoder layers (first and
   last by default), the target's final norm and its embedding matrix, tied to
   the LM head and frozen: the draft shares the tokenizer exactly, and only the
   few layers (and the norm) train. Its head scores ``draft_vocab`` token ids
   (``choose_draft_vocab``; written to loading.DRAFT_VOCAB_FILE), the rows a
   worker keeps of it: most of a small draft's per-token cost is the head.
4. **Distillation.** Cross-entropy of the student's masked distribution over the
   draft vocabulary against the teacher's masked top-k (KL up to the teacher's
   constant entropy), over the positions the worker would ask the draft for,
   with AdamW and cosine decay.

The result is an ordinary HF directory (safetensors, config, the target's
tokenizer files), which ``DraftModelProposer`` loads like any draft.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The user turn of a chat prompt: the same request the chat benchmarks send.
# Bump when the pipeline changes in a way the config cannot see: a cached draft is then rebuilt.
RECIPE_VERSION = 2
USER_TURN = "Generate a JSON object that matches the schema."
# Seed offsets so the schema draw, the student's data order and any init are independent streams.
_SCHEMA_SEED = 0
_ORDER_SEED = 1
_WARMUP_FRACTION = 0.05
_MIN_LR_FRACTION = 0.1


@dataclass(frozen=True)
class DistillConfig:
    """Everything that decides the draft's weights (with the target): the recipe in the manifest."""

    layers: tuple[int, ...] = (0, -1)  # target layers copied into the draft, in order; negative from the end
    num_schemas: int = 40
    max_new_tokens: int = 96
    max_prompt_tokens: int = 768  # longer prompts are skipped (generation cost is quadratic-ish in them)
    gen_batch_size: int = 8
    top_k: int = 16  # teacher probabilities kept per position
    epochs: int = 2
    accumulate: int = 4  # sequences per optimizer step
    lr: float = 1e-3
    seed: int = 0
    threads: int = 2  # torch CPU threads during the build: results are reproducible per thread count
    # Tokens the draft's LM head scores (loading.DRAFT_VOCAB_FILE): the ones the teacher's constrained
    # outputs use most, then the lowest ids (a BPE vocabulary's earliest, most frequent merges).
    # 0 = the whole vocabulary.
    draft_vocab: int = 8192

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["layers"] = list(self.layers)  # the manifest round-trips through JSON
        return out


@dataclass
class Sample:
    """One teacher decode: the prompt, its constrained greedy output, and per output position the
    teacher's masked top-k, the packed grammar mask and whether the grammar forced the token."""

    prompt: list[int]
    output: list[int]  # includes the stop token when the grammar completed
    topk_ids: torch.Tensor  # [n, K] int64
    topk_logp: torch.Tensor  # [n, K] float32, masked-and-renormalised log-probs (-inf past the allowed set)
    bitmask: torch.Tensor  # [n, W] int32, xgrammar's packed mask
    forced: torch.Tensor  # [n] bool


def _set_threads(n: int) -> int:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def build_prompts(tokenizer: Any, schemas: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Chat prompts as the server renders them when the tokenizer has a chat template, else a plain
    instruction line (the tiny test tokenizers have none)."""
    from specmask.common.schema_instruction import schema_instruction

    prompts = []
    for schema in schemas:
        system = schema_instruction(json.dumps(schema))
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": USER_TURN}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = f"{system}\n{USER_TURN}\n"
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return prompts


@torch.no_grad()
def teacher_decode(
    target: Any,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    schemas: Sequence[dict[str, Any]],
    stop_ids: Sequence[int],
    config: DistillConfig,
    on_batch: Callable[[int], None] | None = None,
) -> list[Sample]:
    """Constrained greedy decodes of ``prompts`` by ``target``, ``gen_batch_size`` at a time."""
    import xgrammar as xgr

    vocab = int(target.config.vocab_size)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=list(stop_ids))
    compiler = xgr.GrammarCompiler(info)
    pad = int(stop_ids[0])
    # Similar lengths batch together: left padding then wastes little of the prefill.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    samples: dict[int, Sample] = {}
    for start in range(0, len(order), config.gen_batch_size):
        idx = order[start : start + config.gen_batch_size]
        compiled = [
            compiler.compile_json_schema(
                json.dumps(schemas[i]), any_whitespace=False, separators=(",", ":"), strict_mode=True
            )
            for i in idx
        ]
        for i, s in zip(idx, _decode_batch(target, [prompts[i] for i in idx], compiled, stop_ids, pad, config)):
            samples[i] = s
        if on_batch is not None:
            on_batch(len(idx))
    return [samples[i] for i in range(len(prompts))]


def _decode_batch(
    target: Any, prompts: list[list[int]], compiled: list[Any], stop_ids: Sequence[int], pad: int, config: DistillConfig
) -> list[Sample]:
    import xgrammar as xgr

    vocab = int(target.config.vocab_size)
    b = len(prompts)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((b, width), pad, dtype=torch.long)  # [B, L] left-padded
    attention = torch.zeros((b, width), dtype=torch.long)  # [B, L]
    for r, p in enumerate(prompts):
        input_ids[r, width - len(p) :] = torch.tensor(p)
        attention[r, width - len(p) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # [B, L]
    matchers = [xgr.GrammarMatcher(c) for c in compiled]
    bitmask = xgr.allocate_token_bitmask(b, vocab)  # [B, W] int32
    outputs: list[list[int]] = [[] for _ in range(b)]
    recs: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]] = [[] for _ in range(b)]
    done = [False] * b
    out = target(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
    past = out.past_key_values
    logits = out.logits[:, -1].float()  # [B, V]
    next_pos = positions[:, -1:] + 1  # [B, 1]
    for _ in range(config.max_new_tokens):
        for r in range(b):
            if not done[r]:
                matchers[r].fill_next_token_bitmask(bitmask, r)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        logp = torch.log_softmax(logits, dim=-1)  # [B, V]
        top = logp.topk(config.top_k, dim=-1)
        allowed = torch.isfinite(logits).sum(-1)  # [B]
        step_tokens = []
        for r in range(b):
            if done[r]:
                step_tokens.append(pad)
                continue
            tok = int(top.indices[r, 0])
            recs[r].append((top.indices[r].clone(), top.values[r].clone(), bitmask[r].clone(), int(allowed[r]) == 1))
            outputs[r].append(tok)
            if not matchers[r].accept_token(tok):
                raise RuntimeError(f"the grammar rejected token {tok} its own mask allowed")
            if tok in stop_ids or matchers[r].is_terminated():
                done[r] = True
            step_tokens.append(tok)
        if all(done):
            break
        attention = torch.cat([attention, torch.ones((b, 1), dtype=torch.long)], dim=1)
        out = target(
            input_ids=torch.tensor(step_tokens).unsqueeze(1),
            attention_mask=attention,
            position_ids=next_pos,
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
    samples = []
    for r in range(b):
        ids, logps, masks, forced = zip(*recs[r])
        samples.append(
            Sample(
                prompt=list(prompts[r]),
                output=outputs[r],
                topk_ids=torch.stack(ids),
                topk_logp=torch.stack(logps),
                bitmask=torch.stack(masks),
                forced=torch.tensor(forced, dtype=torch.bool),
            )
        )
    return samples


def init_student(target: Any, layers: Sequence[int]) -> Any:
    """A Llama of the target's ``layers`` (in order), its final norm and its frozen, tied embedding."""
    total = int(target.config.num_hidden_layers)
    picked = [i % total for i in layers]
    if len(set(picked)) != len(picked) or not picked:
        raise ValueError(f"draft layers {list(layers)} must name distinct layers of the target's {total}")
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = len(picked)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in picked]
    config.tie_word_embeddings = True
    student = type(target)(config).to(torch.float32)
    state = {}
    for key, value in target.state_dict().items():
        parts = key.split(".")
        if "layers" in parts and parts[parts.index("layers") + 1].isdigit():
            at = parts.index("layers") + 1
            src = int(parts[at])
            if src not in picked:
                continue
            parts[at] = str(picked.index(src))
            state[".".join(parts)] = value.detach().clone()
        elif key != "lm_head.weight":
            state[key] = value.detach().clone()
    missing, unexpected = student.load_state_dict(state, strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"draft init: missing {missing[:3]}, unexpected {unexpected[:3]}")
    student.tie_weights()
    student.model.embed_tokens.weight.requires_grad_(False)
    student.generation_config = target.generation_config
    return student


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's packed int32 rows [n, W] -> allowed [n, vocab] bool (bit j of word w = token 32w + j)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [n, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def choose_draft_vocab(samples: Sequence[Sample], size: int, vocab: int) -> list[int]:
    """The ``size`` token ids a draft scores (sorted): those the teacher's masked top-k ranks
    highest over all ``samples`` (its choice counts 4, each other kept candidate 1), then the
    lowest ids not yet in. Empty when ``size`` is 0 or covers the whole vocabulary."""
    if size <= 0 or size >= vocab:
        return []
    weights = torch.zeros(vocab, dtype=torch.float64)
    for s in samples:
        finite = torch.isfinite(s.topk_logp)  # [n, K]
        weights.index_add_(0, s.topk_ids[finite], torch.ones(int(finite.sum()), dtype=torch.float64))
        weights.index_add_(0, s.topk_ids[:, 0], torch.full((len(s.output),), 3.0, dtype=torch.float64))
    # Heaviest first; a stable sort keeps the lower id first among equal weights.
    order = torch.argsort(weights, descending=True, stable=True)
    return sorted(order[:size].tolist())


class DraftVocab:
    """Where the student's logit columns sit in the target vocabulary (identity when ``ids`` is empty)."""

    def __init__(self, ids: Sequence[int], vocab: int) -> None:
        self.vocab = vocab
        self.ids = torch.tensor(list(ids), dtype=torch.long) if ids else None  # [n] or None
        # [V]: the column of each token, -1 = not scored.
        if self.ids is None:
            self.column = torch.arange(vocab)
        else:
            self.column = torch.full((vocab,), -1, dtype=torch.long)
            self.column[self.ids] = torch.arange(len(self.ids))
        self._head: torch.Tensor | None = None  # [n, d]: the head's rows at ``ids``, gathered once

    def logits(self, student: Any, hidden: torch.Tensor) -> torch.Tensor:  # [m, d] -> [m, n] float32
        if self.ids is None:
            return student.lm_head(hidden).float()
        if self._head is None:
            # The head is tied to the frozen embedding, so its rows never change: gather them once,
            # not per sample (a 19 MB copy each time for SmolLM2 at 8,192 ids).
            weight = student.get_output_embeddings().weight
            if weight.requires_grad:
                raise ValueError("a draft vocabulary needs the student's LM head frozen")
            self._head = weight[self.ids].detach()
        return (hidden @ self._head.T).float()

    def allowed(self, bitmask: torch.Tensor) -> torch.Tensor:  # [m, W] packed -> [m, n] bool
        full = _unpack(bitmask, self.vocab)
        return full if self.ids is None else full[:, self.ids]


def _output_hidden(student: Any, sample: Sample) -> torch.Tensor:
    """The student's last hidden state at the positions predicting each output token: [n, d]."""
    ids = torch.tensor(sample.prompt + sample.output[:-1]).unsqueeze(0)  # [1, T]
    hidden = student.model(input_ids=ids).last_hidden_state[0]
    first = len(sample.prompt) - 1  # position predicting output[0]
    return hidden[first : first + len(sample.output)]


def _sample_loss(student: Any, sample: Sample, vocab: DraftVocab, allowed: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of the masked student against the teacher's masked top-k over the
    sample's unforced positions where the draft vocabulary holds an allowed token and one of the
    teacher's candidates; (loss, positions). ``allowed``: ``vocab.allowed`` of the unforced
    positions' masks [m, n_cols] (the caller keeps it across epochs)."""
    keep = ~sample.forced  # [n]
    if not bool(keep.any()):
        return torch.zeros(()), 0
    cols = vocab.column[sample.topk_ids[keep]]  # [m, K], -1 = not scored
    p = torch.softmax(sample.topk_logp[keep], dim=-1) * (cols >= 0)  # 0 past the allowed set or vocabulary
    mass = p.sum(-1)  # [m]
    rows = allowed.any(-1) & (mass > 0)  # [m]
    count = int(rows.sum())
    if count == 0:
        return torch.zeros(()), 0
    h = _output_hidden(student, sample)[keep][rows]  # [c, d]
    logits = vocab.logits(student, h)  # [c, n_cols]
    logq = torch.log_softmax(logits.masked_fill(~allowed[rows], float("-inf")), dim=-1)
    p = p[rows] / mass[rows].unsqueeze(-1)  # renormalised over the kept, scored candidates
    q_at = logq.gather(1, cols[rows].clamp(min=0))  # [c, K]
    terms = torch.where(p > 0, p * q_at, torch.zeros_like(p))
    return -terms.sum(), count


def _lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, int(steps * _WARMUP_FRACTION))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (_MIN_LR_FRACTION + (1 - _MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_student(
    student: Any,
    samples: Sequence[Sample],
    config: DistillConfig,
    vocab: DraftVocab,
    on_step: Callable[[float], None] | None = None,
) -> float:
    """Distil for ``config.epochs``; returns the mean per-position loss of the last epoch."""
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + _ORDER_SEED)
    per_epoch = math.ceil(len(samples) / config.accumulate)
    steps = per_epoch * config.epochs
    # The unpacked masks, once: they are the same every epoch (m x n_cols bools per sample).
    allowed = [vocab.allowed(s.bitmask[~s.forced]) for s in samples]
    student.train()
    step = 0
    last_sum = last_count = 0.0
    for epoch in range(config.epochs):
        perm = torch.randperm(len(samples), generator=gen).tolist()
        for chunk_start in range(0, len(perm), config.accumulate):
            chunk = perm[chunk_start : chunk_start + config.accumulate]
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, steps, config.lr)
            opt.zero_grad(set_to_none=True)
            # Forward per sample, backward once: the per-position mean needs the chunk's count.
            losses = [_sample_loss(student, samples[i], vocab, allowed[i]) for i in chunk]
            total = sum(count for _, count in losses)
            chunk_loss = 0.0
            if total:
                (torch.stack([loss for loss, count in losses if count]).sum() / total).backward()
                chunk_loss = sum(float(loss.detach()) for loss, _ in losses)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
            if epoch == config.epochs - 1:
                last_sum += chunk_loss
                last_count += total
            step += 1
            if on_step is not None:
                on_step(chunk_loss / max(1, total))
    student.eval()
    return last_sum / max(1.0, last_count)


@torch.no_grad()
def greedy_agreement(student: Any, samples: Sequence[Sample], vocab: DraftVocab, k: int = 4) -> dict[str, Any]:
    """On teacher decodes: ``greedy_agreement`` = P[masked student argmax == teacher token] over
    unforced positions; ``acceptance_by_position`` = P[draft i accepted | drafts 1..i-1 accepted]
    for i = 1..k of greedy speculation started at every output position (forced positions count as
    accepted, as the grammar-forced proposer drafts them exactly); ``tokens_per_forward`` = the
    mean accepted run + 1 (the target's own token), what that simulation predicts per verify."""
    agree = count = 0
    reached = [0] * k
    accepted = [0] * k
    runs = starts = 0
    for s in samples:
        logits = vocab.logits(student, _output_hidden(student, s))  # [n, n_cols]
        allowed = vocab.allowed(s.bitmask)
        best = logits.masked_fill(~allowed, float("-inf")).argmax(-1)
        pred = best if vocab.ids is None else vocab.ids[best]
        # A row with nothing allowed in the draft's vocabulary proposes nothing (DraftModelProposer).
        ok = ((pred == s.topk_ids[:, 0]) & allowed.any(-1)) | s.forced  # [n]
        keep = ~s.forced
        agree += int((ok & keep).sum())
        count += int(keep.sum())
        hits = ok.tolist()
        for t in range(len(hits)):
            run = 0
            for i in range(k):
                if t + i >= len(hits):
                    break
                reached[i] += 1
                if not hits[t + i]:
                    break
                accepted[i] += 1
                run += 1
            runs += run
            starts += 1
    return {
        "greedy_agreement": agree / max(1, count),
        "positions": float(count),
        "acceptance_by_position": [round(a / max(1, r), 4) for a, r in zip(accepted, reached)],
        "tokens_per_forward": round(1 + runs / max(1, starts), 3),
    }


def distill_draft(target_dir: Path, out_dir: Path, config: DistillConfig, *, progress: bool = True) -> dict[str, Any]:
    """Build the draft for the model in ``target_dir`` into ``out_dir`` (absent on entry); returns
    facts for the manifest (sizes, timings, agreement on held-back teacher decodes)."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specmask.gpu_worker.loading import DRAFT_VOCAB_FILE, eos_token_ids
    from specmask.gpu_worker.models.distill_schemas import random_schemas

    before = _set_threads(config.threads)
    try:
        torch.manual_seed(config.seed)
        started = time.monotonic()
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
        target = AutoModelForCausalLM.from_pretrained(
            str(target_dir), dtype=torch.float32, local_files_only=True, attn_implementation="sdpa"
        ).eval()
        stop_ids = eos_token_ids(str(target_dir), tokenizer)
        if not stop_ids:
            raise ValueError(f"{target_dir}: no EOS token; cannot tell when a document ends")
        schemas = random_schemas(config.num_schemas, config.seed * 1_000_003 + _SCHEMA_SEED)
        prompts = build_prompts(tokenizer, schemas)
        kept = [i for i, p in enumerate(prompts) if len(p) <= config.max_prompt_tokens]
        schemas = [schemas[i] for i in kept]
        prompts = [prompts[i] for i in kept]
        with tqdm(total=len(prompts), desc="teacher decodes", unit="schema", disable=not progress) as bar:
            samples = teacher_decode(target, tokenizer, prompts, schemas, stop_ids, config, on_batch=bar.update)
        generated = time.monotonic()
        # Every 8th decode is held back from training to measure the draft on unseen schemas.
        held = samples[::8]
        train = [s for i, s in enumerate(samples) if i % 8 != 0]
        vocab_size = int(target.config.vocab_size)
        draft_ids = choose_draft_vocab(train, config.draft_vocab, vocab_size)
        vocab = DraftVocab(draft_ids, vocab_size)
        student = init_student(target, config.layers)
        del target
        before_training = greedy_agreement(student, held, vocab)
        steps = math.ceil(len(train) / config.accumulate) * config.epochs
        with tqdm(total=steps, desc="distil", unit="step", disable=not progress) as bar:

            def tick(loss: float) -> None:
                bar.set_postfix_str(f"loss={loss:.3f}", refresh=False)
                bar.update(1)

            final_loss = train_student(student, train, config, vocab, on_step=tick)
        trained = time.monotonic()
        after_training = greedy_agreement(student, held, vocab)
        out_dir.mkdir(parents=True)
        student.save_pretrained(out_dir, safe_serialization=True)
        if draft_ids:
            (out_dir / DRAFT_VOCAB_FILE).write_text(json.dumps(draft_ids))
        for f in Path(target_dir).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
                shutil.copy2(f, out_dir / f.name)
        positions = sum(len(s.output) for s in samples)
        forced = sum(int(s.forced.sum()) for s in samples)
        return {
            "config": config.to_json(),
            "num_parameters": sum(p.numel() for p in student.parameters()),
            "trainable_parameters": sum(p.numel() for p in student.parameters() if p.requires_grad),
            "draft_vocab": len(draft_ids) or vocab_size,
            "teacher_decodes": len(samples),
            "teacher_positions": positions,
            "teacher_forced_positions": forced,
            "final_loss": round(final_loss, 4),
            "heldout_agreement_before": round(before_training["greedy_agreement"], 4),
            "heldout_agreement_after": round(after_training["greedy_agreement"], 4),
            "heldout_positions": int(after_training["positions"]),
            "heldout_acceptance_by_position": after_training["acceptance_by_position"],
            "heldout_tokens_per_forward_k4": after_training["tokens_per_forward"],
            "generate_seconds": round(generated - started, 1),
            "train_seconds": round(trained - generated, 1),
        }
    finally:
        torch.set_num_threads(before)
