"""Per-request decoding state (request state, kept apart from engine state).

A ``SequenceState`` is the source of truth for one sequence: its committed
tokens, its two KV caches (whose lengths say how much of those tokens each model
has already seen), its mask session, and the commit that has not yet reached the
mask service. ``commit`` applies the finish rules of ``FinishReason`` to a step's
emitted tokens.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specmask.gpu_worker.kv_cache import SequenceKV
from specmask.gpu_worker.types import FinishReason, NewSequence

if TYPE_CHECKING:
    from specmask.gpu_worker.masks import OpenedSession

logger = logging.getLogger(__name__)


@dataclass
class SequenceState:
    request: NewSequence
    # The request's stop set (or the model's EOS), joined once the mask session opens by the
    # tokens its grammar ends on (masks.OpenedSession): nothing may follow any of them.
    stop_token_ids: frozenset[int]
    proposers: tuple[str, ...]  # enabled proposer names, registry priority order; () = no speculation
    k: int  # max drafts per step for this sequence (0 = plain decoding)
    seed: int  # per-request seed (the request's, or drawn by the worker)
    token_ids: list[int]  # committed tokens x: prompt + output
    target_kv: SequenceKV = field(default_factory=SequenceKV)
    draft_kv: SequenceKV | None = None  # None when the draft model is not used by this sequence
    session_id: str | None = None  # mask session, once open; None = no grammar, or still opening
    # The session being opened (add() does not wait for it): the sequence sits out steps
    # until it resolves, so it never takes a step without its masks.
    session_opening: Future[OpenedSession] | None = None
    opening_since: float = 0.0  # time.monotonic() when the open was sent
    # How the open met the first steps (GpuWorker.step): steps sat out, a late join, and
    # whether the first output has reported them (StepOutput.session_wait).
    steps_sat_out: int = 0
    joined_late: bool = False
    session_wait_reported: bool = False
    # Emitted tokens the mask service has not seen yet: they ride, as commit_tokens,
    # on the next draft-mask request (docs/design.md "commit can ride on the next request").
    pending_commit: list[int] = field(default_factory=list)
    commit_seq: int = 0  # sequence number of the latest commit handed to the mask service (>= 1 once used)
    step: int = 0  # steps taken; mixed into the sampling seed so every step draws fresh randomness
    finished: FinishReason | None = None
    # Prompt tokens to cache by prefill chunks before the first step (which feeds the rest);
    # the sequence does not step until its target cache reaches this length.
    prefill_to: int = 0

    @property
    def seq_id(self) -> str:
        return self.request.seq_id

    @property
    def request_id(self) -> str:
        """The orchestrator's request id (named in every log line about the sequence)."""
        return self.request.log_request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def prefilling(self) -> bool:
        """Its prompt is still being cached chunk by chunk: it holds its KV slot, not a step row."""
        return self.target_kv.length < self.prefill_to

    @property
    def has_grammar(self) -> bool:
        # The request's, not "has a session": a grammar sequence is never treated as free.
        return self.request.grammar is not None

    @property
    def mask_session(self) -> str:
        """The open mask session's id; only asked of a sequence that sent a mask request."""
        assert self.session_id is not None, f"seq {self.seq_id} has no mask session"
        return self.session_id

    def stop_suppressed(self, num_positions: int) -> int:
        """Of the next ``num_positions`` output positions, how many come before the request's
        min_tokens: their stop tokens are suppressed (kernels.stop_suppression)."""
        return max(0, min(num_positions, self.request.sampling.min_tokens - self.num_output))

    @property
    def min_tokens_stop_ids(self) -> tuple[int, ...]:
        """Every id a position before min_tokens may not emit: the stop set and the request's own."""
        return tuple(sorted(self.stop_token_ids | set(self.request.sampling.min_tokens_stop_ids)))

    def next_commit(self) -> tuple[list[int], int]:
        """(commit_tokens, commit_seq) to attach to this step's mask requests.

        Every request of a step carries the same pair: the first one applies it,
        the rest are no-ops at the service (a seen commit_seq is ignored), so the
        commit is never lost whichever request reaches the service first.
        """
        return list(self.pending_commit), self.commit_seq

    def commit(self, emitted: list[int], *, max_model_len: int) -> tuple[list[int], FinishReason | None]:
        """Append a step's emitted tokens; return (tokens kept, finish reason or None).

        Order of the rules: a stop token ends the output (it is not returned) ->
        GRAMMAR_COMPLETE with a grammar, STOP without; then the max_tokens budget and
        the model length truncate -> LENGTH.
        """
        kept: list[int] = []
        reason: FinishReason | None = None
        for tok in emitted:
            if tok in self.stop_token_ids:
                reason = FinishReason.GRAMMAR_COMPLETE if self.has_grammar else FinishReason.STOP
                break
            kept.append(tok)
        budget = min(
            self.request.sampling.max_tokens - self.num_output,
            max_model_len - len(self.token_ids),
        )
        over_budget = len(kept) > budget
        budget_spent = len(kept) == budget and reason is None
        if over_budget or budget_spent:
            kept = kept[: max(budget, 0)]
            reason = FinishReason.LENGTH
        self.token_ids.extend(kept)
        if self.has_grammar and kept:
            self.pending_commit = list(kept)
            self.commit_seq += 1
        self.step += 1
        return kept, reason
