"""Plain constrained greedy decoding, written independently of gpu_worker.

One full (uncached) HF forward per token, xgrammar's own matcher and its own
``apply_token_bitmask_inplace``, argmax. This is the ground truth the
speculative worker must reproduce token for token (docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch


@dataclass
class ReferenceOutput:
    tokens: list[int]  # output tokens, stop token excluded
    finish: str  # "stop" | "length"
    min_gap: float  # smallest top-1 minus top-2 masked logit seen (a tie would make greedy ambiguous)


@lru_cache(maxsize=4)
def _model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


@lru_cache(maxsize=4)
def _tokenizer_info(path: str, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=list(stop_ids))


def compile_grammar(model_dir: Path, kind: str, text: str, stop_ids: tuple[int, ...]) -> Any:
    """Compile like the mask service does for GrammarSpec defaults (compact JSON, strict)."""
    import xgrammar as xgr

    vocab = _model(str(model_dir)).config.vocab_size
    compiler = xgr.GrammarCompiler(_tokenizer_info(str(model_dir), vocab, stop_ids))
    if kind == "json_schema":
        return compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"), strict_mode=True)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    raise ValueError(kind)


@torch.no_grad()
def greedy_constrained(
    model_dir: Path,
    prompt: list[int],
    compiled: Any | None,
    stop_ids: tuple[int, ...],
    max_tokens: int,
    max_len: int | None = None,
    min_tokens: int = 0,
) -> ReferenceOutput:
    """``min_tokens``: stop tokens are removed before that many output tokens (vLLM's
    min_tokens); a position where nothing is left ends the output with finish "conflict"."""
    import xgrammar as xgr

    model = _model(str(model_dir))
    vocab = model.config.vocab_size
    max_len = max_len or model.config.max_position_embeddings
    matcher = xgr.GrammarMatcher(compiled) if compiled is not None else None
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    ids = list(prompt)
    out: list[int] = []
    min_gap = float("inf")
    while True:
        logits = model(torch.tensor([ids])).logits[0, -1].float().unsqueeze(0)  # [1, V]
        if matcher is not None:
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
        if len(out) < min_tokens:
            logits[0, list(stop_ids)] = float("-inf")
            if not torch.isfinite(logits).any():
                return ReferenceOutput(out, "conflict", min_gap)
        top2 = logits[0].topk(2).values
        if torch.isfinite(top2[1]):
            min_gap = min(min_gap, float(top2[0] - top2[1]))
        token = int(logits[0].argmax())
        if matcher is not None and not matcher.accept_token(token):
            raise AssertionError(f"reference picked a token the grammar rejects: {token}")
        if token in stop_ids:
            return ReferenceOutput(out, "stop", min_gap)
        out.append(token)
        ids.append(token)
        if len(out) >= max_tokens or len(ids) >= max_len:
            return ReferenceOutput(out, "length", min_gap)


@torch.no_grad()
def exact_distribution(
    model_dir: Path, prompt: list[int], compiled: Any, temperature: float
) -> dict[tuple[int, ...], float]:
    """Probability of every complete output (stop token included) of sequential sampling
    from the grammar-masked target at ``temperature``; the grammar must be finite."""
    import xgrammar as xgr

    model = _model(str(model_dir))
    vocab = model.config.vocab_size
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    out: dict[tuple[int, ...], float] = {}

    def walk(tokens: list[int], prob: float) -> None:
        if matcher.is_terminated():
            out[tuple(tokens)] = prob
            return
        logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float().unsqueeze(0)  # [1, V]
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        p = torch.softmax(logits[0] / temperature, dim=-1)  # [V]
        for token in torch.nonzero(p > 0).flatten().tolist():
            if not matcher.accept_token(token):
                raise AssertionError(f"grammar rejects a token its own mask allowed: {token}")
            walk(tokens + [token], prob * float(p[token]))
            matcher.rollback(1)

    walk([], 1.0)
    return out
