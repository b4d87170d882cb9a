"""Which new sequences a worker takes, and the state each one starts with.

``Admission.admit`` checks one ``NewSequence`` against the worker's limits (its batch size,
model length and vocabulary, the sampling and speculation ranges, the mask service, the KV
budget) and builds its ``SequenceState``, seed drawn. A refusal raises ValueError or
TypeError; ``Admission.admit_batch`` checks the requests of one ``GpuWorker.add`` in turn and
hands a refusal's message back as that sequence's error (logged under its request id).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specmask.common.proposer_kind import ProposerKind
from specmask.gpu_worker.kv_budget import KVBudget
from specmask.gpu_worker.kv_cache import SequenceKV
from specmask.gpu_worker.proposers.registry import order_names
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.types import MAX_TOP_LOGPROBS, NewSequence

logger = logging.getLogger(__name__)

SEED_BITS = 63  # kernels take int64 seeds; keep them non-negative


@dataclass(frozen=True)
class WorkerLimits:
    """What a worker can serve, fixed once its models are loaded and its KV budget sized."""

    vocab_size: int  # V: target logits width; every token id is below it
    max_model_len: int  # prompt plus output, as the KV budget may have lowered it
    max_batch: int  # active sequences at once
    max_k: int  # drafts per step
    eos_token_ids: tuple[int, ...]  # the stop set of a request that names none
    proposers: frozenset[str]  # the proposers this worker built (a request may ask for fewer)
    draft_vocab_size: int | None  # the draft model's input vocabulary; None without one
    has_mask_service: bool  # grammars need one


class Admission:
    """The worker's checks on new sequences (see the module docstring)."""

    def __init__(self, limits: WorkerLimits, kv_budget: KVBudget | None, *, seed: int | None) -> None:
        self.limits = limits
        self.kv_budget = kv_budget  # None = unbounded
        self._rng = random.Random(seed)  # seeds of requests that bring none

    def need(self, s: SequenceState) -> int:
        """Positions per slot ``s`` reserves under the KV budget (kv_budget.KVBudget.need)."""
        assert self.kv_budget is not None
        return self.kv_budget.need(s.prompt_len, s.request.sampling.max_tokens)

    def admit_batch(
        self, reqs: Sequence[Any], active: Mapping[str, SequenceState]
    ) -> tuple[list[str | None], list[tuple[int, SequenceState]]]:
        """Check the requests of one add() in order, each against the ones taken before it:
        per request None or why it is refused (logged), and (index, state) of the ones taken."""
        errors: list[str | None] = [None] * len(reqs)
        accepted: list[tuple[int, SequenceState]] = []
        seen: set[str] = set()
        for i, req in enumerate(reqs):
            try:
                state = self.admit(req, active, seen, [s for _, s in accepted])
            except (ValueError, TypeError) as exc:
                errors[i] = str(exc)
                rid = getattr(req, "request_id", "") or getattr(req, "seq_id", "?")
                logger.warning("[request_id=%s] seq %s refused: %s", rid, getattr(req, "seq_id", "?"), exc)
                continue
            seen.add(req.seq_id)
            accepted.append((i, state))
        return errors, accepted

    def admit(
        self, req: Any, active: Mapping[str, SequenceState], seen: Collection[str], accepted: Sequence[SequenceState]
    ) -> SequenceState:
        """Check one request and build its state (raises ValueError/TypeError with a clear
        message). ``active``: the sequences the worker holds, by id; ``seen``: the ids this add() has
        taken so far; ``accepted``: the states it has admitted before this one."""
        lim = self.limits
        if not isinstance(req, NewSequence):
            raise TypeError(f"expected NewSequence, got {type(req).__name__}")
        if not isinstance(req.seq_id, str) or not req.seq_id:
            raise ValueError("seq_id must be a non-empty string")
        if req.seq_id in active or req.seq_id in seen:
            raise ValueError(f"duplicate seq_id {req.seq_id!r}")
        if len(active) + len(accepted) >= lim.max_batch:
            raise ValueError(f"worker is full ({lim.max_batch} active sequences)")
        prompt = list(req.prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        self.check_ids(prompt, "prompt")
        if len(prompt) >= lim.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room below max_model_len {lim.max_model_len}")
        p = req.sampling
        if not (math.isfinite(p.temperature) and p.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
        if p.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {p.top_k}")
        if p.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
        if p.logprobs is not None and not 0 <= p.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.logprobs}")
        spec = req.speculation
        if not 0 <= spec.k <= lim.max_k:
            raise ValueError(f"speculation k must be in [0, {lim.max_k}], got {spec.k}")
        proposers: tuple[str, ...] = ()
        if spec.enabled and spec.k > 0:
            proposers = tuple(n for n in order_names(spec.proposers) if n in lim.proposers)
        if req.grammar is not None and not lim.has_mask_service:
            raise ValueError("sequence has a grammar but the worker has no mask service configured")
        stop_ids = lim.eos_token_ids if req.stop_token_ids is None else tuple(req.stop_token_ids)
        self.check_ids(stop_ids, "stop")
        if ProposerKind.DRAFT_MODEL in proposers:
            assert lim.draft_vocab_size is not None  # the draft_model proposer is built only with a draft
            if max(prompt) >= lim.draft_vocab_size:
                raise ValueError(f"prompt token id {max(prompt)} is outside the draft vocabulary")
        if self.kv_budget is not None:
            # The orchestrator places a request only where it fits (engine._place); this is the
            # worker's own guard, so a pool never has to grow past its budget mid-step.
            needs = [self.need(s) for s in (*active.values(), *accepted)]
            needs.append(self.kv_budget.need(len(prompt), p.max_tokens))
            if not self.kv_budget.fits(needs):
                raise ValueError(
                    f"KV budget full: {len(needs)} sequences would reserve {self.kv_budget.reserved(needs)} of its "
                    f"{self.kv_budget.positions} slot-positions; retry when running ones finish"
                )
        seed = p.seed if p.seed is not None else self._rng.getrandbits(SEED_BITS)
        return SequenceState(
            request=req,
            stop_token_ids=frozenset(stop_ids),
            proposers=proposers,
            k=spec.k if proposers else 0,
            seed=seed & ((1 << SEED_BITS) - 1),
            token_ids=prompt,
            draft_kv=SequenceKV() if ProposerKind.DRAFT_MODEL in proposers else None,
        )

    def check_ids(self, ids: Sequence[int], what: str) -> None:
        """Raise ValueError unless every one of ``ids`` is a token id of the vocabulary (not a bool)."""
        vocab = self.limits.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"{what} token id {t!r} outside [0, {vocab})")
