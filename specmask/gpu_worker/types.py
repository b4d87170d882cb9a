"""Request-facing value types of the worker (what crosses the Ray boundary).

Terms used across the package, defined once:
* *committed tokens* x: prompt + tokens already returned to the caller;
* *drafts* d_1..d_k: proposed continuations, k = k_r <= K for request r;
* *accepted drafts*: the prefix of the drafts the rejection sampler keeps;
* *recovered token*: the token emitted at the first rejected position;
* *bonus token*: the token emitted after all k drafts were accepted;
* *emitted tokens*: accepted drafts + one recovered or bonus token (1..k+1).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specmask.common.grammar_spec import GrammarSpec
from specmask.common.proposer_kind import ProposerKind
from specmask.gpu_worker.kv_budget import KVBudget


class FinishReason(enum.Enum):
    """Why a sequence stopped. Precise definitions (checked in this order per step):

    * ``GRAMMAR_COMPLETE``: the sequence has a grammar and its matcher is terminated
      after the committed tokens; in practice the emitted tokens contain a stop
      token, which a grammar mask allows only where the document is complete, so
      accepting it terminates the matcher. Tokens after it are dropped and the stop
      token itself is not returned.
    * ``STOP``: no grammar, and an emitted token is in the stop set (not returned).
    * ``LENGTH``: the output reached ``max_tokens`` (emitted tokens are truncated to
      the budget) or prompt + output reached the model's maximum length.
    * ``CANCELLED``: removed by ``remove()`` (never reported by ``step()``).
    * ``ERROR``: the sequence failed (message in ``StepOutput.error``); it is freed.
    * ``GRAMMAR_VIOLATION``: output that breaks the grammar was caught —
      by the rejection sampler's mask check (the offending token is never emitted)
      or by the orchestrator's end-of-request check; never a success. Message in
      ``StepOutput.error``; the sequence is freed.
    """

    STOP = "stop"
    LENGTH = "length"
    GRAMMAR_COMPLETE = "grammar_complete"
    CANCELLED = "cancelled"
    ERROR = "error"
    GRAMMAR_VIOLATION = "grammar_violation"


class ErrorKind(enum.Enum):
    """What kind of failure ended a sequence (``StepOutput.error_kind``, set with ``error``): it
    decides how each API reports the failure, in one table (specmask/orchestrator/api/error_table.py),
    so no layer reads the message's words to find out.

    * ``INTERNAL``: the server failed at it (a step or worker call raised, the worker was lost,
      no worker left); the request was fine.
    * ``MASK_TIER_UNAVAILABLE``: no mask service replica answered in time; a retry may succeed.
    * ``MIN_TOKENS_UNREACHABLE``: the request's min_tokens conflicts with its own grammar (the
      grammar ends, or allows only a stop token, before the minimum): the caller's to fix.
    * ``GRAMMAR_VIOLATION``: output breaking the grammar was caught (FinishReason.GRAMMAR_VIOLATION).
    """

    INTERNAL = "internal"
    MASK_TIER_UNAVAILABLE = "mask_tier_unavailable"
    MIN_TOKENS_UNREACHABLE = "min_tokens_unreachable"
    GRAMMAR_VIOLATION = "grammar_violation"

    @classmethod
    def of(cls, reason: FinishReason, kind: ErrorKind | None = None) -> ErrorKind | None:
        """The kind of failure a sequence that finished with ``reason`` had: for ERROR, ``kind``
        when one was set, else INTERNAL; GRAMMAR_VIOLATION's own whatever ``kind`` says (never
        reported as anything else); None for a reason that is no failure (STOP, LENGTH,
        GRAMMAR_COMPLETE, CANCELLED)."""
        if reason is FinishReason.GRAMMAR_VIOLATION:
            return cls.GRAMMAR_VIOLATION
        if reason is FinishReason.ERROR:
            return kind if kind is not None else cls.INTERNAL
        return None


class SessionWait(enum.Enum):
    """How a grammar sequence's first step met its mask session, which ``add()`` opens
    without waiting for (specmask/gpu_worker/actor.py): the cost of the mask tier's open latency,
    reported once per sequence (``StepOutput.session_wait``).

    * ``READY``: open when the first step it could take began;
    * ``JOINED_LATE``: it opened while a step proposed its drafts, and the sequence
      joined that step's verify forward without drafts (after ``steps_sat_out`` whole
      steps, usually none);
    * ``SAT_OUT``: the sequence sat out ``StepOutput.steps_sat_out`` >= 1 whole steps first.
    """

    READY = "ready"
    JOINED_LATE = "joined_late"
    SAT_OUT = "sat_out"


# How a sequence's error starts when min_tokens cannot be met under its grammar (a position before
# the minimum where the grammar allows only stop tokens): a conflict between the request's own
# constraints, which the API layers report as such.
MIN_TOKENS_UNREACHABLE = "min_tokens cannot be met"

# The most alternatives a position's logprobs list (OpenAI's top_logprobs bound; the same
# bound as specmask.kernels.logprobs.MAX_TOP_LOGPROBS, which cannot import this torch-free module's layer).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How target tokens are drawn. ``temperature == 0`` is greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0  # 1.0 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None: the worker draws one (output is then not reproducible across runs)
    max_tokens: int = 256  # output budget, stop token excluded
    # None: no log-probabilities (the step pays nothing for them). N >= 0: every emitted token's
    # log-probability plus the N (<= 20) most likely tokens at its position (StepOutput.logprobs;
    # the definition is specmask.kernels.logprobs's).
    logprobs: int | None = None
    # vLLM's min_p in [0, 1] (0 = off): after temperature, before top-k/top-p, tokens with
    # probability below min_p times the most likely allowed token's are removed (kernels.probs).
    min_p: float = 0.0
    # No stop token (the sequence's stop set: EOS and any stop_token_ids) at output positions
    # before this many output tokens (kernels.stop_suppression); 0 = off. A grammar that allows
    # only a stop token there fails the sequence (FinishReason.ERROR) instead.
    min_tokens: int = 0
    # With min_tokens: ids removed before the minimum besides the stop set (the request's
    # stop_token_ids, which the orchestrator ends the output on).
    min_tokens_stop_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SpeculationParams:
    """Per-request speculation. ``k`` is the maximum drafts per step (k_r <= k <= WorkerConfig.max_k).

    ``proposers`` names registry entries (gpu_worker.proposers.registry); they are
    consulted per draft position in their registry priority order, not tuple order:
    grammar_forced, then ngram, then draft_model. "draft_model" is ignored on a
    worker configured without a draft model.
    ``draft_masking``: mask the draft model's logits at position i with the grammar
    state after d_1..d_{i-1} (one batched mask round trip per draft position, in flight
    while that position's draft forward runs; see specmask/gpu_worker/drafting.py).
    """

    enabled: bool = True
    k: int = 4
    proposers: tuple[str, ...] = (ProposerKind.DRAFT_MODEL, ProposerKind.GRAMMAR_FORCED)
    draft_masking: bool = True


@dataclass(frozen=True)
class NewSequence:
    """A sequence to prefill and decode. The orchestrator has validated ``grammar``."""

    seq_id: str
    prompt_token_ids: tuple[int, ...]
    grammar: GrammarSpec | None
    sampling: SamplingParams = SamplingParams()
    speculation: SpeculationParams = SpeculationParams()
    stop_token_ids: tuple[int, ...] | None = None  # None: the tokenizer's EOS ids
    # The orchestrator's request id ('' = seq_id): named in the worker's log lines about
    # the sequence and sent with its mask session, so one request can be followed
    # through the orchestrator, worker and mask-service logs.
    request_id: str = ""

    @property
    def log_request_id(self) -> str:
        """The id to log: ``request_id``, or ``seq_id`` when none was given."""
        return self.request_id or self.seq_id


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target's grammar-masked distribution at its
    position (log_softmax(masked logits / T), T = 1 for greedy, before min-p/top-k/top-p, with
    the stop tokens a min_tokens request may not emit there masked too; see
    specmask.kernels.logprobs), and the most likely tokens there: (token id, logprob) pairs,
    most likely first, grammar-forbidden tokens never included (so there may be fewer than asked)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepOutput:
    """What one step did for one sequence (one per active sequence per step)."""

    seq_id: str
    new_token_ids: list[int]  # emitted tokens kept after stop/length truncation
    finish_reason: FinishReason | None = None
    error: str | None = None  # set iff finish_reason is ERROR or GRAMMAR_VIOLATION
    # With ``error``: what kind of failure. None reads as the finish reason's kind: INTERNAL for
    # ERROR, GRAMMAR_VIOLATION for GRAMMAR_VIOLATION (ErrorKind.of).
    error_kind: ErrorKind | None = None
    drafts_proposed: int = 0  # k_r this step
    drafts_accepted: int = 0  # accepted drafts this step (before truncation)
    target_forwards: int = 0  # 1 when the sequence took part in this step's target forward
    mask_time_s: float = 0.0  # wall time this step waited on the mask service for this batch
    # On a grammar sequence's first output only (None otherwise): how its session open met
    # its first step, and how many steps it sat out waiting for it.
    session_wait: SessionWait | None = None
    steps_sat_out: int = 0
    # Sequences that asked for logprobs (SamplingParams.logprobs): one per new_token_ids entry.
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Iteration:
    """What ``GpuWorker.iterate`` did: a step loop's remove, add and step in one call."""

    add_errors: list[str | None]  # per added sequence, as add() returns
    outputs: list[StepOutput]  # as step() returns ([] when nothing was active)
    # Removed ids the worker did not hold (finished on the worker, or refused by add(),
    # while the orchestrator's cancel was queued): expected, not errors.
    unknown_removed: list[str] = field(default_factory=list)


# Ray concurrency group of ``GpuWorker.progress`` (gpu_worker.actor.start_remote_worker): a
# thread of its own, so the heartbeat answers while an iteration runs; every other method stays
# in the default group, one call at a time.
LIVENESS_GROUP = "liveness"


@dataclass(frozen=True)
class WorkerProgress:
    """``GpuWorker.progress``: the heartbeat the orchestrator's liveness check reads."""

    count: int  # prefill forwards and steps finished since the worker started; moves while it works
    active: int  # sequences held (prefilling or decoding)


@dataclass(frozen=True)
class WorkerInfo:
    """Static facts about a loaded worker."""

    vocab_size: int  # V: target logits width (may exceed the tokenizer's vocabulary)
    max_model_len: int  # prompt + output never exceed this
    tokenizer_id: str  # mask_service.tokenizer_id.tokenizer_id_for_path(target_dir)
    eos_token_ids: tuple[int, ...]  # default stop set
    device: str  # "cuda:0", "cpu", ...
    has_draft_model: bool
    max_k: int
    pid: int = 0  # the worker process (a restarted actor has a new one)
    # Owner its mask sessions carry (stable across actor restarts; '' = none): lets the
    # orchestrator release them when the worker is lost.
    session_owner: str = ""
    torch_threads: int = 0  # torch intra-op threads the worker process runs with
    # The KV budget and its admission rule (gpu_worker.kv_budget): the orchestrator places a
    # request only where it fits. None = unbounded pools.
    kv_budget: KVBudget | None = None

    def serves_same_model(self, other: WorkerInfo) -> bool:
        """Interchangeable for the orchestrator: same tokenizer, logits width and length limit."""
        return (self.tokenizer_id, self.vocab_size, self.max_model_len) == (
            other.tokenizer_id,
            other.vocab_size,
            other.max_model_len,
        )


class UnknownSequenceError(KeyError):
    """``remove`` named sequence ids this worker does not hold.

    Defined here, not in actor.py, so the orchestrator can catch it (it crosses
    Ray as a task error's cause) without importing the worker's torch code.
    """

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""
