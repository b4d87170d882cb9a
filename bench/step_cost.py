"""The grammar machinery's cost per worker step, measured against a like-for-like peer.

    python -m bench.step_cost        # SmolLM2-135M-Instruct (+ its distilled draft) if cached, else the toy pair
    python -m bench.step_cost --draft none                      # no draft model: grammar-forced + n-gram
    python -m bench.step_cost --proposers draft_model,grammar_forced   # a chosen proposer mix

Why a replay. bench.e2e divides the constrained phase's mean step time by an
unconstrained phase's. That phase decodes the same prompts without a grammar, so
it generates other text: other drafts, other acceptance (1.01 tokens per forward
against 1.44 on SmolLM2), other verify widths, other batch sizes as requests
finish at other steps. Its step time differs for reasons that have nothing to do
with the grammar, and on this box the ratio swung 0.65-1.80 between rounds.

The peer here is the constrained run itself, replayed without the grammar:

* **record** (``constrained``): the in-process ``GpuWorker`` decodes every
  schema, greedy, with its grammar and speculation as configured (draft-side
  mask requests on). Per sequence and step the trace keeps the drafts each
  iteration of the proposal loop added (pre width trim), which proposers did
  model or lookup work for which slots at which iteration (a draft forward: its
  ``prepare``; sampling or an n-gram lookup: its ``propose``), the verify width
  after the trim, and the emitted tokens with the accepted count.
* **replay** (``peer``): the same prompts, *no grammar* (no mask session, so no
  mask request, wait, row lookup, bitmask, forced-token test or mask check in
  the sampler), through the same ``StepRunner`` code. A ``replay`` proposer
  hands back the recorded drafts iteration by iteration and, for cost, calls the
  real draft-model / n-gram proposers on exactly the recorded slots (the same
  batched draft forwards over the same tokens; their tokens are discarded). The
  width chooser still runs but the recorded width is kept; the target forward
  and the rejection sampler run unmasked over the same rows, and the recorded
  tokens are committed instead of the unmasked argmax. So both runs take the same
  number of steps, with the same sequences in every batch, the same target and
  draft forward shapes and the same KV growth; they differ in the grammar work
  only (checked: batch composition per step and outputs must match).

Rounds alternate the order (record, replay / replay, record), each on a freshly
added batch, so a slow spell of the shared box hits both. A round's ratio is
Σ constrained step time / Σ peer step time over its steps (prefill excluded); the
headline ``constrained_vs_unconstrained_step_time`` is the median over rounds
(goal <= 1.05). Also reported: the median of per-step ratios (step t of one run
against step t of the other), the mask wait left on the critical path (time the
step blocked on the mask service), mask round trips (batched DraftMasks calls)
per step, tokens per target forward, and, once, whether the constrained outputs
equal plain constrained decoding without speculation (greedy: they must).

The mask service runs as its own process (as in production), on this host.
Prints a table, the load average, and last ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.soak import cpu_seconds
from bench.worker import tally_outputs
from specmask.common.proposer_kind import ProposerKind
from specmask.gpu_worker.drafting import Drafter
from specmask.gpu_worker.mask_errors import MaskFailure
from specmask.gpu_worker.proposers.base import DraftSlot, Proposal, Proposer
from specmask.gpu_worker.speculation_gate import SpeculationGate
from specmask.gpu_worker.step import StepRunner
from specmask.gpu_worker.verify_width import _DECAY, WidthChooser

logger = logging.getLogger(__name__)

REAL_MODEL = "smollm2-135m-instruct"
# The user turn of chat prompts (the schema goes in the system turn, as in bench.e2e --chat).
CHAT_USER_TURN = "Generate a JSON object that matches the schema."
# Proposers whose work is the grammar machinery itself: the replay skips them.
GRAMMAR_PROPOSERS = frozenset({ProposerKind.GRAMMAR_FORCED})

Key = tuple[str, int]  # (seq_id, the sequence's step index before the step's commit)


@dataclass
class StepTrace:
    """What one sequence's step did in the constrained run."""

    drafts: list[int] = field(default_factory=list)  # d_1..d_k before the width trim
    # Proposal-loop iteration -> drafts the slot held when the iteration ended.
    counts: dict[int, int] = field(default_factory=dict)
    # Iteration -> proposer name -> drafts the slot held when that proposer's prepare ran for it.
    prepared: dict[int, dict[str, int]] = field(default_factory=dict)
    # Iteration -> proposers whose propose ran for the slot.
    proposed: dict[int, set[str]] = field(default_factory=dict)
    # (context length, limit) of every n-gram lookahead computed for this step's requests
    # (drafting.py "Lookahead"; the position-1 one was sent at the end of the step before).
    lookaheads: list[tuple[int, int]] = field(default_factory=list)
    verified: int | None = None  # drafts kept by the width trim (verified by the target)
    emitted: list[int] | None = None  # emitted tokens (None: not committed through verify)
    num_accepted: int = 0


class Trace(dict[Key, StepTrace]):
    """Key -> StepTrace for one constrained run."""

    def at(self, slot: DraftSlot) -> StepTrace:
        return self.of(slot.seq)

    def of(self, seq: Any) -> StepTrace:
        """The record of ``seq``'s current step (created on first use)."""
        # Not setdefault(key, StepTrace()): that builds a StepTrace on every call, and the
        # recording's cost lands on the constrained run's step time only (the replay has none).
        key = (seq.seq_id, seq.step)
        rec = self.get(key)
        if rec is None:
            rec = self[key] = StepTrace()
        return rec


# -- recording (the constrained run) -------------------------------------------------------------
class _RecordingProposer:
    """A real proposer, recording for which slots its prepare / propose ran."""

    def __init__(self, inner: Proposer, trace: Trace, drafter: _RecordingDrafter) -> None:
        self._inner = inner
        self._trace = trace
        self._drafter = drafter

    def __getattr__(self, name: str) -> Any:  # name, priority, prepares, needs_masks, ...
        return getattr(self._inner, name)

    def prepare(self, slots: Sequence[DraftSlot], position: int) -> None:
        for s in slots:
            self._trace.at(s).prepared.setdefault(position, {})[self._inner.name] = len(s.drafts)
        self._inner.prepare(slots, position)

    def propose(self, slots: Sequence[DraftSlot], position: int) -> list[Proposal | None]:
        for s in slots:
            self._trace.at(s).proposed.setdefault(position, set()).add(self._inner.name)
        return self._inner.propose(slots, position)

    def chain(self, context: Sequence[int], limit: int) -> list[int]:
        self._trace.of(self._drafter.lookahead_seq).lookaheads.append((len(context), limit))
        return self._inner.chain(context, limit)  # type: ignore[attr-defined]  # wraps the n-gram proposer


class _RecordingDrafter(Drafter):
    """The real Drafter; notes how many drafts every slot holds as each loop iteration ends."""

    def __init__(self, proposers: dict[str, Proposer], masks: Any, *, mask_timeout_s: float, trace: Trace) -> None:
        self.trace = trace
        wrapped = {name: _RecordingProposer(p, trace, self) for name, p in proposers.items()}
        super().__init__(wrapped, masks, mask_timeout_s=mask_timeout_s)  # type: ignore[arg-type]  # duck-typed wrappers
        self._position = 1
        self._slots: Sequence[DraftSlot] = ()
        self.lookahead_seq: Any = None  # the sequence whose lookahead is being computed

    def propose(self, slots: Sequence[DraftSlot], errors: dict[str, MaskFailure], *, masked: bool = True) -> float:
        self._position, self._slots = 1, slots
        waited = super().propose(slots, errors, masked=masked)
        self._note()
        for s in slots:
            self.trace.at(s).drafts = list(s.drafts)
        return waited

    def _note(self) -> None:
        for s in self._slots:
            self.trace.at(s).counts[self._position] = len(s.drafts)

    def _fill(self, slots, position, proposers):  # type: ignore[override]  # over a staticmethod, to record
        self._position = position
        pending = super()._fill(slots, position, proposers)
        self._note()
        return pending

    def _apply(self, reply, slots, errors):
        waited = super()._apply(reply, slots, errors)
        self._note()
        return waited

    def _lookahead(self, seq, context, limit):
        self.lookahead_seq = seq
        return super()._lookahead(seq, context, limit)


class RecordingStepRunner(StepRunner):
    """``StepRunner`` of the constrained run: records a ``Trace``."""

    def __init__(self, *args: Any, trace: Trace, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trace = trace
        self.drafter = _RecordingDrafter(
            self.drafter.proposers, self.masks, mask_timeout_s=self.mask_timeout_s, trace=trace
        )

    def _commit(self, slot: DraftSlot, emitted: list[int], num_accepted: int) -> Any:
        rec = self.trace.at(slot)
        rec.verified, rec.emitted, rec.num_accepted = len(slot.drafts), list(emitted), num_accepted
        return super()._commit(slot, emitted, num_accepted)


# -- replay (the peer) ---------------------------------------------------------------------------
class ReplayProposer(Proposer):
    """Hands back the recorded drafts; runs the recorded proposers' work for cost only."""

    name = "replay"
    priority = -1
    prepares = True  # so the Drafter calls prepare (the recorded draft forwards) before propose

    def __init__(self, real: dict[str, Proposer]) -> None:
        self.real = {n: p for n, p in real.items() if n not in GRAMMAR_PROPOSERS}
        self.trace = Trace()

    @classmethod
    def create(cls, resources: Any) -> None:
        """Never built by a worker: the bench installs one over the worker's real proposers."""
        return None

    def _catch_up(self, slot: DraftSlot, count: int) -> None:
        """Add recorded drafts until ``slot`` holds ``count``."""
        drafts = self.trace[(slot.seq.seq_id, slot.seq.step)].drafts
        while len(slot.drafts) < count:
            slot.add(Proposal(drafts[len(slot.drafts)]), self.name)

    def _rec(self, slot: DraftSlot) -> StepTrace:
        key = (slot.seq.seq_id, slot.seq.step)
        if key not in self.trace:
            raise RuntimeError(f"replay: no recorded step {key}; the runs diverged")
        return self.trace[key]

    def prepare(self, slots: Sequence[DraftSlot], position: int) -> None:
        by_name: dict[str, list[DraftSlot]] = defaultdict(list)
        ngram = self.real.get(ProposerKind.NGRAM)
        if position == 1 and ngram is not None:
            for s in slots:  # the step's n-gram lookaheads, over the same tokens (for their cost)
                rec = self._rec(s)
                for length, limit in rec.lookaheads:
                    context = s.seq.token_ids + rec.drafts[: length - len(s.seq.token_ids)]
                    ngram.chain(context, limit)  # type: ignore[attr-defined]  # the n-gram proposer, found by name
        for s in slots:
            for name, count in self._rec(s).prepared.get(position, {}).items():
                if name in self.real:
                    self._catch_up(s, count)  # a forced run the constrained slot held before its forward
                    by_name[name].append(s)
        for name, subset in by_name.items():
            self.real[name].prepare(subset, position)

    def propose(self, slots: Sequence[DraftSlot], position: int) -> list[Proposal | None]:
        by_name: dict[str, list[DraftSlot]] = defaultdict(list)
        for s in slots:
            for name in self._rec(s).proposed.get(position, ()):
                if name in self.real:
                    by_name[name].append(s)
        for name in sorted(by_name, key=lambda n: (self.real[n].priority, n)):
            self.real[name].propose(by_name[name], position)  # the work, not the tokens
        out: list[Proposal | None] = []
        for s in slots:
            rec = self._rec(s)
            count = rec.counts.get(position, len(s.drafts))
            if count <= len(s.drafts):
                # An iteration that added nothing but kept the slot open (a lookahead slot
                # re-asking one state, drafting.py): its later drafts come now, or the
                # Drafter would close the slot. Such slots run no draft forward, so the
                # forward schedule is unchanged.
                count = max((c for p, c in rec.counts.items() if p > position), default=count)
            if count <= len(s.drafts):
                out.append(None)  # the constrained slot got nothing more: drafting stops here too
                continue
            self._catch_up(s, count - 1)
            out.append(Proposal(rec.drafts[count - 1]))
        return out


class _ReplayWidth(WidthChooser):
    """Runs the width choice (its cost) but keeps the recorded width."""

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace

    def trim(self, slots: Sequence[DraftSlot]) -> int:
        for entry in self.stats.values():
            entry[0] *= _DECAY
            entry[1] *= _DECAY
        self.choose(slots)
        dropped = 0
        for s in slots:
            verified = self.trace[(s.seq.seq_id, s.seq.step)].verified
            if verified is None:
                raise RuntimeError(f"replay: seq {s.seq.seq_id} step {s.seq.step} was not verified when recorded")
            dropped += s.trim(verified)
        return dropped


class ReplayStepRunner(StepRunner):
    """``StepRunner`` of the peer: recorded drafts and widths, recorded tokens committed."""

    def __init__(self, *args: Any, replay: ReplayProposer, **kwargs: Any) -> None:
        super().__init__(*args, width=_ReplayWidth(replay.trace), **kwargs)
        self.replay = replay

    def _commit(self, slot: DraftSlot, emitted: list[int], num_accepted: int) -> Any:
        rec = self.replay.trace[(slot.seq.seq_id, slot.seq.step)]
        if rec.emitted is None or rec.verified != len(slot.drafts):
            raise RuntimeError(
                f"replay: seq {slot.seq.seq_id} step {slot.seq.step} does not match its recording "
                f"({len(slot.drafts)} drafts of k={slot.k} to verify, {rec.verified} recorded)"
            )
        return super()._commit(slot, list(rec.emitted), rec.num_accepted)


# -- running ---------------------------------------------------------------------------------------
@dataclass
class RunStats:
    """One run (all sequences to completion)."""

    step_s: list[float] = field(default_factory=list)  # per batched step, wall time of worker.step()
    mask_wait_s: list[float] = field(default_factory=list)  # per step, time blocked on the mask service
    round_trips: list[int] = field(default_factory=list)  # per step, batched DraftMasks calls sent
    batches: list[tuple[str, ...]] = field(default_factory=list)  # per step, the sequences stepped
    outputs: dict[str, list[int]] = field(default_factory=dict)
    tokens: int = 0  # emitted tokens, stop token included
    forwards: int = 0  # Σ per-sequence target forwards
    proposed: int = 0
    accepted: int = 0
    draft_forwards: int = 0  # batched draft-model forwards (0 without a draft model)

    @property
    def total_s(self) -> float:
        return sum(self.step_s)


class _CallCounter:
    """Counts batched DraftMasks calls on a worker's mask channel (mask round trips)."""

    def __init__(self, channel: Any) -> None:
        self.calls = 0
        inner = channel.draft_masks_async

        def counted(items: Any) -> Any:
            self.calls += 1
            return inner(items)

        channel.draft_masks_async = counted


class Run:
    """One worker decoding one batch of sequences to completion, a timed step at a time."""

    def __init__(self, worker: Any, stepper: StepRunner, seqs: Sequence[Any], counter: _CallCounter) -> None:
        """Adds ``seqs`` (prefill: untimed) to ``worker``, which then steps with ``stepper``."""
        worker.stepper = stepper
        pending = list(seqs)
        for _ in range(60):
            errors = worker.add(pending, wait_for_sessions=True)
            failed = [(seq, err) for seq, err in zip(pending, errors, strict=True) if err]
            # On a busy host a cold grammar can outlast the open's deadline: the service keeps
            # compiling it and refuses with "still compiling"; add those sequences again.
            if not failed or any("still compiling" not in err for _, err in failed):
                break
            pending = [seq for seq, _ in failed]
            time.sleep(1.0)
        if failed:
            raise RuntimeError(f"add failed: {[err for _, err in failed][:3]}")
        self.worker, self.stepper, self.counter = worker, stepper, counter
        self.stats = RunStats(outputs={s.seq_id: [] for s in seqs})
        self._draft_forwards0 = worker.draft.num_forwards if worker.draft is not None else 0

    @property
    def active(self) -> bool:
        return self.worker.num_active() > 0

    def step(self) -> None:
        """One timed ``worker.step()``, then (untimed) let the next step's position-1 mask
        request land: in the served stack it is in flight while the orchestrator handles
        the step's outputs, not during another worker's step."""
        stats, worker = self.stats, self.worker
        batch = tuple(worker.active_ids())
        calls0 = self.counter.calls
        t0 = time.perf_counter()
        outs = worker.step()
        stats.step_s.append(time.perf_counter() - t0)
        stats.round_trips.append(self.counter.calls - calls0)
        stats.mask_wait_s.append(max((o.mask_time_s for o in outs), default=0.0))
        stats.batches.append(batch)
        tally_outputs(outs, stats)
        if worker.draft is not None:
            stats.draft_forwards = worker.draft.num_forwards - self._draft_forwards0
        self.stepper.drafter.settle_prefetch()


def run_interleaved(runs: Sequence[Run]) -> None:
    """Step ``runs`` to completion, one step each in turn, the order rotating every turn, so a
    slow spell of the shared machine hits the runs' same-numbered steps alike."""
    turn = 0
    while any(r.active for r in runs):
        order = list(runs)
        for r in order[turn % len(order) :] + order[: turn % len(order)]:
            if r.active:
                r.step()
        turn += 1


def _register_replay() -> bool:
    """Make ``replay`` a proposer name requests may carry (explicit: no work at import).
    Returns whether this call added it (the caller then removes it when done: the registry is
    process-wide, and a run inside a test process must not leave ``replay`` behind)."""
    from specmask.gpu_worker.proposers.registry import register, registered_names

    if ReplayProposer.name in registered_names():
        return False
    register(ReplayProposer)
    return True


def _resolve_models(args: argparse.Namespace) -> tuple[str, str | None]:
    from specmask.gpu_worker.models.resolve import NO_DRAFT, resolve_pair

    target = args.target
    if target is None:
        from specmask.gpu_worker.models.cache import cache_root

        cached = cache_root() / REAL_MODEL
        if cached.is_dir():
            target = REAL_MODEL
        else:
            from specmask.gpu_worker.toy.build import DEFAULT_OUT_DIR, build_toy_models

            toy = build_toy_models(DEFAULT_OUT_DIR, progress=False)
            return str(toy.target_dir), (str(toy.draft_dir) if args.draft != "none" else None)
    # resolve_pair reads None as "the target's default draft" and NO_DRAFT as no draft at all.
    return resolve_pair(target, NO_DRAFT if args.draft == "none" else args.draft, progress=False)


def load_cases(args: argparse.Namespace, tokenizer: Any) -> list[tuple[str, Any, list[int]]]:
    """(name, schema, prompt ids): the toy schemas, or a dir of JSON Schemas; chat prompts when
    the tokenizer has a chat template (the schema in the system turn), else the toy prompt."""
    from specmask.common.schema_instruction import schema_instruction
    from specmask.gpu_worker.toy.schemas import all_schemas, prompt_for, schema_json

    if args.schemas == "toy":
        schemas = dict(all_schemas())
    else:
        schemas = {}
        for path in sorted(Path(args.schemas).glob("*.json")):
            doc = json.loads(path.read_text())
            schemas[path.stem] = doc["schema"] if isinstance(doc, dict) and "schema" in doc else doc
    names = sorted(schemas)[: args.n] if args.n else sorted(schemas)
    cases = []
    for name in names:
        if getattr(tokenizer, "chat_template", None):
            messages = [
                {"role": "system", "content": schema_instruction(schema_json(schemas[name]))},
                {"role": "user", "content": CHAT_USER_TURN},
            ]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(prompt_for(name, schemas[name]))
        cases.append((name, schemas[name], list(ids)))
    if not cases:
        raise SystemExit(f"no schemas in {args.schemas}")
    return cases


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help=f"target dir or registered name (default: {REAL_MODEL} if cached, else toy)")
    parser.add_argument(
        "--draft",
        default=None,
        help="draft dir or registered name; 'none': no draft; unset: the target's distilled draft when cached",
    )
    parser.add_argument(
        "--proposers",
        default=None,
        help="comma list (default: the server's, grammar_forced,ngram; with a draft model, draft_model too)",
    )
    parser.add_argument("--schemas", default="toy", help="'toy' (the toy pair's 18 schemas) or a dir of *.json")
    parser.add_argument("--n", type=int, default=9, help="schemas (sequences decoded as one batch; default 9)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4, help="record/replay pairs, order alternating")
    parser.add_argument("--no-nospec-check", action="store_true", help="skip the no-speculation output check")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument(
        "--static-forward", default="auto", choices=("auto", "on", "off"), help="WorkerConfig.static_forward"
    )
    parser.add_argument("--mask-threads", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    added_replay = _register_replay()
    try:
        return _run(args)
    finally:
        if added_replay:
            from specmask.gpu_worker.proposers.registry import unregister

            unregister(ReplayProposer)


def _run(args: argparse.Namespace) -> int:
    """Record and replay ``args.rounds`` times; print the table and RESULT."""
    from specmask.common.grammar_spec import GrammarKind, GrammarSpec
    from specmask.gpu_worker.actor import GpuWorker
    from specmask.gpu_worker.config import WorkerConfig
    from specmask.gpu_worker.toy.schemas import schema_json
    from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams
    from specmask.orchestrator.dev.local_stack import MaskServiceProcess
    from specmask.orchestrator.validation import DRAFT_MODEL_PROPOSERS, DRAFTLESS_PROPOSERS

    target_dir, draft_dir = _resolve_models(args)
    if args.proposers:
        proposers = tuple(p for p in args.proposers.split(",") if p)
    else:
        proposers = DRAFT_MODEL_PROPOSERS if draft_dir else DRAFTLESS_PROPOSERS  # what the server defaults to
    load_start = os.getloadavg()
    # A long wall-clock backstop for compiles: on a busy shared host the default (30 s) can stop a
    # starved compile again and again, and the batch never starts.
    service_args = ["--mask-threads", str(args.mask_threads), "--compile-wall-timeout-s", "900"]
    service = MaskServiceProcess([target_dir], extra_args=service_args)
    service.start(wait=False)
    service.wait_serving(timeout_s=600.0)  # loading the tokenizer takes minutes on a busy shared host
    workers: list[Any] = []
    try:
        config = WorkerConfig(
            target_dir=target_dir,
            draft_dir=draft_dir,
            device="cpu",
            mask_service_addresses=(service.address,),
            max_k=max(args.k, 1),
            torch_threads=args.torch_threads,
            step_prefill_tokens=1,  # prompts prefilled in add(), untimed: the timed steps are decode steps
            static_forward=args.static_forward,
        )
        # Two workers over one set of weights: the constrained run and its replay step side by
        # side, each with its own KV pool, mask channel and sequences.
        constrained_worker = GpuWorker(config)
        workers.append(constrained_worker)
        peer_worker = GpuWorker(
            config,
            target_model=constrained_worker.target.model,
            draft_model=constrained_worker.draft.model if constrained_worker.draft is not None else None,
        )
        workers.append(peer_worker)
        cases = load_cases(args, constrained_worker.tokenizer)
        replay = ReplayProposer(peer_worker.proposers)
        peer_worker.proposers[ReplayProposer.name] = replay
        # Admission keeps the proposers the worker built when it was made: without ``replay``
        # there, add() would drop it from the peer's sequences, which would then not draft.
        limits = peer_worker.admission.limits
        peer_worker.admission.limits = replace(limits, proposers=limits.proposers | {ReplayProposer.name})
        base = constrained_worker.stepper
        common = {
            "max_model_len": base.max_model_len,
            "draft_max_len": base.draft_max_len,
            "mask_timeout_s": config.mask_deadline_s * 4,
            # Both runs speculate at every step: the replay follows the recording step for step.
            "gate": SpeculationGate(enabled=False),
        }
        counters = {id(w): _CallCounter(w.masks) for w in workers}
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

        def seqs(kind: str) -> list[Any]:
            if kind == "peer":
                draft = (ProposerKind.DRAFT_MODEL,) if ProposerKind.DRAFT_MODEL in proposers else ()
                names = (ReplayProposer.name, *draft)
                spec = SpeculationParams(k=args.k, proposers=names, draft_masking=False)
            else:
                spec = SpeculationParams(enabled=kind != "nospec", k=args.k, proposers=proposers, draft_masking=True)
            return [
                NewSequence(
                    seq_id=name,
                    prompt_token_ids=tuple(ids),
                    grammar=None if kind == "peer" else GrammarSpec(GrammarKind.JSON_SCHEMA, schema_json(schema)),
                    sampling=greedy,
                    speculation=spec,
                )
                for name, schema, ids in cases
            ]

        def record() -> tuple[Run, Trace]:
            w = constrained_worker
            trace = Trace()
            stepper = RecordingStepRunner(
                w.target, base.drafter.proposers, w.masks, trace=trace, mask_table=w.mask_table, **common
            )
            return Run(w, stepper, seqs("constrained"), counters[id(w)]), trace

        def peer(trace: Trace) -> Run:
            w = peer_worker
            replay.trace = trace
            stepper = ReplayStepRunner(
                w.target, {replay.name: replay}, w.masks, replay=replay, mask_table=w.mask_table, **common
            )
            return Run(w, stepper, seqs("peer"), counters[id(w)])

        print(
            f"target={target_dir} draft={draft_dir} proposers={','.join(proposers)} k={args.k} "
            f"sequences={len(cases)} max_tokens={args.max_tokens} rounds={args.rounds} load={load_start}"
        )
        # Warm-up (first-use costs: allocator, grammar compiles) and the first trace, then its
        # replay once (the peer worker's warm-up).
        first, trace = record()
        run_interleaved([first])
        warm = peer(trace)
        run_interleaved([warm])
        nospec_same = None
        if not args.no_nospec_check:
            nospec = Run(constrained_worker, base, seqs("nospec"), counters[id(constrained_worker)])
            run_interleaved([nospec])
            nospec_same = [
                sum(first.stats.outputs[n] == nospec.stats.outputs[n] for n in first.stats.outputs),
                len(first.stats.outputs),
            ]
        rounds: list[tuple[RunStats, RunStats]] = []
        service_cpu_s = 0.0
        assert service.process is not None  # started above
        service_pid = service.process.pid
        discarded = 0
        for r in range(3 * args.rounds):
            if len(rounds) == args.rounds:
                break
            # Greedy decoding repeats itself: this round's recording replays the last one's trace.
            a, new_trace = record()
            b = peer(trace)
            cpu0 = cpu_seconds(service_pid)
            run_interleaved([a, b] if r % 2 == 0 else [b, a])
            sa, sb = a.stats, b.stats
            if sa.outputs != first.stats.outputs or sb.outputs != sa.outputs:
                raise AssertionError(f"round {r}: constrained and replayed outputs diverged")
            trace = new_trace
            if sa.batches != sb.batches or sa.draft_forwards != sb.draft_forwards:
                # Same tokens, other drafts: the service's learned spellings of forced text
                # (mask_service/grammar/spellings.py) changed between the two recordings, so
                # the replay is not like for like. Discarded; the next round replays this one.
                discarded += 1
                continue
            # All of it is the constrained run's: the replay opens no mask session.
            service_cpu_s += cpu_seconds(service_pid) - cpu0
            rounds.append((sa, sb))
        if len(rounds) < args.rounds:
            raise AssertionError(f"only {len(rounds)} of {args.rounds} rounds replayed like for like")
    finally:
        for w in workers:
            w.shutdown()
        service.stop()
    load_end = os.getloadavg()

    ratios = [a.total_s / b.total_s for a, b in rounds]
    per_step = [x / y for a, b in rounds for x, y in zip(a.step_s, b.step_s) if y > 0]
    steps = sum(len(a.step_s) for a, _ in rounds)
    service_cpu_ms = 1e3 * service_cpu_s / max(steps, 1)
    a_all = [t for a, _ in rounds for t in a.step_s]
    b_all = [t for _, b in rounds for t in b.step_s]
    wait = [t for a, _ in rounds for t in a.mask_wait_s]
    trips = [t for a, _ in rounds for t in a.round_trips]
    ref = rounds[0][0]
    rows = [
        ("constrained (grammar on)", a_all, wait, trips),
        ("peer (replay, no grammar)", b_all, [t for _, b in rounds for t in b.mask_wait_s], [0] * len(b_all)),
    ]
    print(f"\n{'run':<26} {'steps':>6} {'step ms mean':>13} {'median':>8} {'mask wait ms':>13} {'round trips':>12}")
    for name, times, waits, rt in rows:
        print(
            f"{name:<26} {len(times):>6} {1e3 * statistics.fmean(times):>13.2f} "
            f"{1e3 * statistics.median(times):>8.2f} {1e3 * statistics.fmean(waits):>13.2f} "
            f"{statistics.fmean(rt):>12.2f}"
        )
    print(
        f"per round constrained/peer: {', '.join(f'{x:.3f}' for x in ratios)}; "
        f"tokens per target forward {ref.tokens / max(ref.forwards, 1):.2f} (both runs), "
        f"acceptance {ref.accepted / max(ref.proposed, 1):.0%}; mask service CPU "
        f"{service_cpu_ms:.2f} ms per constrained step; load average {load_start} -> {load_end}"
    )
    result = {
        "constrained_vs_unconstrained_step_time": _median(ratios),
        "constrained_vs_unconstrained_step_time_rounds": [round(x, 4) for x in ratios],
        "per_step_ratio_median": _median(per_step),
        "constrained_step_ms": round(1e3 * statistics.fmean(a_all), 3),
        "peer_step_ms": round(1e3 * statistics.fmean(b_all), 3),
        "mask_wait_ms_per_step": round(1e3 * statistics.fmean(wait), 3),
        "mask_round_trips_per_step": round(statistics.fmean(trips), 3),
        # CPU the mask service spent per constrained step: on a host with few cores it is taken
        # from the forwards it overlaps, so it bounds how far the ratio can fall.
        "mask_service_cpu_ms_per_step": round(service_cpu_ms, 3),
        "tokens_per_target_forward": round(ref.tokens / max(ref.forwards, 1), 3),
        "acceptance_rate": round(ref.accepted / max(ref.proposed, 1), 3),
        "spec_nonspec_identical_outputs": nospec_same,
        "steps_per_run": len(ref.step_s),
        "draft_forwards_per_run": ref.draft_forwards,
        "steps": steps,
        "rounds_discarded": discarded,
        "sequences": len(ref.outputs),
        "proposers": list(proposers),
        "k": args.k,
        "static_forward": args.static_forward,
        "target": target_dir,
        "draft": draft_dir,
        "load_average": [list(load_start), list(load_end)],
        "peer": "replay of the constrained run without grammar work (same drafts, widths, batches, tokens)",
    }
    print("RESULT " + json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
