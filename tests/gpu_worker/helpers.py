"""Shared helpers for worker tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_worker.types import FinishReason, StepOutput


@dataclass
class Finished:
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    error: str | None = None
    steps: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    outputs: list[StepOutput] = field(default_factory=list)


def run_to_completion(worker: Any, *, max_steps: int = 1000) -> dict[str, Finished]:
    """Step until no sequence is active; collect per-sequence results."""
    results: dict[str, Finished] = {}
    for _ in range(max_steps):
        if worker.num_active() == 0:
            return results
        for out in worker.step():
            r = results.setdefault(out.seq_id, Finished())
            r.tokens.extend(out.new_token_ids)
            r.steps += 1
            r.drafts_proposed += out.drafts_proposed
            r.drafts_accepted += out.drafts_accepted
            r.outputs.append(out)
            if out.finish_reason is not None:
                r.finish, r.error = out.finish_reason, out.error
    raise AssertionError(f"still {worker.num_active()} active sequences after {max_steps} steps")


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Temporarily set torch's intra-op threads (tiny matmuls on a shared 2-core box
    run ~50x slower with two contending threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
