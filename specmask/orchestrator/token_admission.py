"""Admission bounded in prompt tokens, beside the request-count bounds.

A request's cost to a worker grows with its prompt: prefill compute (chunked within
the iteration budget, gpu_worker.config.DEFAULT_MAX_ITERATION_TOKENS) and KV memory.
Counting requests alone lets 32 requests of 4k-token prompts in as cheaply as 32 of
ten tokens. Two bounds, each 0 = off:

* ``max_queued_prompt_tokens``: prompt tokens of admitted requests waiting for a worker.
  Past it, submit() refuses with RESOURCE_EXHAUSTED and Retry-After (``Overloaded``),
  before validation when the queue is already over, so the refusal is fast.
* ``max_worker_prompt_tokens``: prompt tokens of the requests placed on one worker and
  not finished (its batch). Placement skips a worker it would push past the bound; a
  worker with nothing placed always takes the next request, so a prompt larger than
  the bound still runs, alone. Requests held back wait in the queue, where a worker
  that dies cannot take them with it and any worker may pick them up.
"""

from __future__ import annotations

from dataclasses import dataclass

from specmask.orchestrator.errors import Overloaded

# A burst of 32 chat requests with ~4k-token system prompts (JSON Schemas, tool lists) is
# ~130k tokens: admitted whole, and queued rather than refused.
DEFAULT_MAX_QUEUED_PROMPT_TOKENS = 1 << 20
# The batch of one worker: enough for 16 such prompts at once (the iteration budget, not
# this bound, keeps each iteration short); KV memory for SmolLM2-135M is ~46 KB a token.
DEFAULT_MAX_WORKER_PROMPT_TOKENS = 1 << 16


@dataclass(frozen=True)
class PromptTokenBounds:
    max_queued_prompt_tokens: int = DEFAULT_MAX_QUEUED_PROMPT_TOKENS  # 0 = no bound
    max_worker_prompt_tokens: int = DEFAULT_MAX_WORKER_PROMPT_TOKENS  # per worker; 0 = no bound

    def __post_init__(self) -> None:
        for name in ("max_queued_prompt_tokens", "max_worker_prompt_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no bound), got {getattr(self, name)}")

    def check_queue(self, queued: int, prompt_tokens: int) -> None:
        """Raise ``Overloaded`` if ``prompt_tokens`` more would pass the queue's bound (before
        validation, when the count is not known yet, ask for 1: is the queue full already). A
        queue holding nothing takes any one request (max_model_len limits it)."""
        bound = self.max_queued_prompt_tokens
        if bound and queued and queued + prompt_tokens > bound:
            raise Overloaded(f"admission queue is full ({queued} prompt tokens waiting, limit {bound}); retry later")

    def fits_worker(self, held: int, prompt_tokens: int) -> bool:
        """Whether a worker whose batch holds ``held`` prompt tokens may take ``prompt_tokens`` more."""
        bound = self.max_worker_prompt_tokens
        return not bound or not held or held + prompt_tokens <= bound
