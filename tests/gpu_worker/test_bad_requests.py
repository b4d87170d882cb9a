"""The worker refuses bad requests with a clear message and keeps serving."""

from __future__ import annotations

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.actor import UnknownSequenceError
from specmask.gpu_worker.mask_errors import MASK_TIER_UNAVAILABLE
from specmask.gpu_worker.types import (
    ErrorKind,
    FinishReason,
    NewSequence,
    SamplingParams,
    SessionWait,
    SpeculationParams,
)
from tests.gpu_worker.helpers import Finished, run_to_completion, wait_sessions_closed, wait_sessions_open

GOOD_GRAMMAR = GrammarSpec(GrammarKind.REGEX, "(yes|no)")


def _seq(seq_id, prompt=(5, 6), grammar=GOOD_GRAMMAR, **kw):
    spec = kw.pop("speculation", SpeculationParams(k=2))
    return NewSequence(seq_id, tuple(prompt), grammar, SamplingParams(**kw), spec)


BAD = {
    "token id": (lambda: _seq("t1", prompt=(5, 300)), "outside [0, 300)"),
    "negative id": (lambda: _seq("t2", prompt=(-1,)), "outside [0, 300)"),
    "empty prompt": (lambda: _seq("t3", prompt=()), "empty"),
    "bad grammar": (lambda: _seq("t4", grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, "{not json")), "grammar"),
    "bad regex": (lambda: _seq("t5", grammar=GrammarSpec(GrammarKind.REGEX, "(unclosed")), "grammar"),
    "unknown proposer": (lambda: _seq("t6", speculation=SpeculationParams(proposers=("oracle",))), "unknown proposer"),
    "k too large": (lambda: _seq("t7", speculation=SpeculationParams(k=99)), "speculation k"),
    "temperature": (lambda: _seq("t8", temperature=-1.0), "temperature"),
    "top_p": (lambda: _seq("t9", top_p=0.0), "top_p"),
    "max_tokens": (lambda: _seq("t10", max_tokens=0), "max_tokens"),
    "stop id": (lambda: NewSequence("t11", (5,), None, stop_token_ids=(1000,)), "stop token id"),
    "prompt too long": (lambda: _seq("t12", prompt=tuple([5] * 256)), "max_model_len"),
    "not a NewSequence": (lambda: {"seq_id": "t13"}, "expected NewSequence"),
}
SESSION_REFUSALS = ("bad grammar", "bad regex")  # refused by the mask service, not by add()'s checks


def test_bad_requests_get_per_sequence_errors_and_worker_keeps_serving(make_worker):
    worker = make_worker()
    assert worker.add([_seq("good", max_tokens=10)]) == [None]
    names = list(BAD)
    errors = worker.add([BAD[n][0]() for n in names] + [_seq("good2", max_tokens=10)])
    assert errors[-1] is None
    # Duplicate ids: against an active sequence, and within one call.
    dup = worker.add([_seq("good"), _seq("new"), _seq("new")])
    assert "duplicate" in dup[0] and dup[1] is None and "duplicate" in dup[2]
    # A grammar the mask service refuses is answered once its session open returns: by add()
    # if that was before add() ended, else by the sequence's first step (an ERROR output).
    late = {BAD[n][0]().seq_id for n, err in zip(names, errors) if n in SESSION_REFUSALS and err is None}
    assert set(worker.active_ids()) == {"good", "good2", "new"} | late
    with pytest.raises(UnknownSequenceError, match="nope"):
        worker.remove(["new", "nope"])
    assert set(worker.active_ids()) == {"good", "good2"} | late  # "new" was removed despite the unknown id
    wait_sessions_open(worker)
    stepped = {out.seq_id: out for out in worker.step()}
    for name, err in zip(names, errors):
        if name in SESSION_REFUSALS and err is None:
            out = stepped[BAD[name][0]().seq_id]
            assert out.finish_reason is FinishReason.ERROR and not out.new_token_ids, (name, out)
            err = out.error
        assert err is not None and BAD[name][1] in err, (name, err)
    assert all(out.error is None for seq_id, out in stepped.items() if seq_id not in late)
    results = run_to_completion(worker)
    assert {r.finish for r in results.values()} <= {FinishReason.GRAMMAR_COMPLETE, FinishReason.LENGTH}
    assert all(r.error is None for r in results.values())


def test_grammar_without_mask_service_is_refused(make_worker):
    worker = make_worker(mask_service_addresses=())
    errors = worker.add([_seq("g"), _seq("plain", grammar=None, max_tokens=3)])
    assert "no mask service" in errors[0] and errors[1] is None
    assert run_to_completion(worker)["plain"].finish is FinishReason.LENGTH


def test_unreachable_mask_service_fails_only_grammar_sequences(make_worker):
    worker = make_worker(mask_service_addresses=("127.0.0.1:1",), mask_deadline_s=0.5)
    errors = worker.add([_seq("g"), _seq("plain", grammar=None, max_tokens=3)])
    assert errors == [None, None]  # a failed open is the step's to report, with its kind
    assert worker._seqs["g"].session_opening.exception(timeout=30) is not None  # answered before any step
    results = run_to_completion(worker)
    assert results["plain"].tokens and results["plain"].error is None
    (failed,) = results["g"].outputs
    assert failed.finish_reason is FinishReason.ERROR and failed.new_token_ids == []
    assert failed.error is not None and failed.error.startswith(MASK_TIER_UNAVAILABLE), failed.error
    assert failed.error_kind is ErrorKind.MASK_TIER_UNAVAILABLE and "127.0.0.1" not in failed.error


def test_full_worker_refuses_more_sequences(make_worker):
    worker = make_worker(max_batch=2)
    errors = worker.add([_seq(f"f{i}", grammar=None) for i in range(3)])
    assert errors[:2] == [None, None] and "full" in errors[2]


def test_draft_model_request_on_a_worker_without_draft_runs_without_it(make_worker):
    worker = make_worker(draft_dir=None)
    assert worker.add([_seq("d", speculation=SpeculationParams(k=3, proposers=("draft_model",)), max_tokens=5)]) == [
        None
    ]
    out = run_to_completion(worker)["d"]
    assert out.drafts_proposed == 0 and out.finish is not None


def test_mask_service_dying_mid_generation_fails_grammar_sequences_only(make_worker, tiny_pair):
    from specmask.mask_service.server.config import MaskServiceConfig
    from specmask.mask_service.server.server import build_service
    from specmask.mask_service.server.tokenizers import TokenizerSource

    handle = build_service(
        MaskServiceConfig(tokenizers=(TokenizerSource(str(tiny_pair[0])),), host="127.0.0.1", port=0, mask_threads=1)
    )
    handle.server.start()
    try:
        worker = make_worker(mask_service_addresses=(f"127.0.0.1:{handle.port}",), mask_deadline_s=0.5)
        long_grammar = GrammarSpec(GrammarKind.REGEX, "[a-z]{40}")
        assert worker.add(
            [_seq("g", grammar=long_grammar, max_tokens=50), _seq("plain", grammar=None, max_tokens=6)]
        ) == [None, None]
        assert all(out.finish_reason is None for out in worker.step())
    finally:
        handle.stop(grace_s=0.1)
    results = run_to_completion(worker)
    assert results["g"].finish is FinishReason.ERROR and "mask service" in results["g"].error
    assert results["plain"].finish is FinishReason.LENGTH and results["plain"].error is None


def test_sessions_open_during_the_prefill_and_a_refused_one_frees_its_kv(make_worker):
    """add() starts the mask sessions opening on the I/O thread and returns at once; the next
    iteration prefills the prompts while the opens are in flight (it does not wait for them);
    a sequence whose session is refused was prefilled meanwhile, and its KV slot is given back.
    (``step_prefill_tokens=1``: these short prompts would otherwise be fed by the first step,
    with no prefill chunk at all.)"""
    import threading
    import time

    worker = make_worker(step_prefill_tokens=1)
    events: list[str] = []
    lock = threading.Lock()
    router = worker.masks._router
    real_open, real_forward = router.open_session_info, worker.target.forward

    def slow_open(*args, **kwargs):
        with lock:
            events.append("open")
        time.sleep(0.1)  # a replica's round trip, slowed so the order is unambiguous
        return real_open(*args, **kwargs)

    def forward(items):
        if any(it.num_logits == 0 for it in items):  # a prompt chunk asks for no logits
            with lock:
                events.append("prefill")
        return real_forward(items)

    router.open_session_info = slow_open
    worker.target.forward = forward
    seqs = [_seq(f"g{i}", max_tokens=4) for i in range(3)] + [BAD["bad grammar"][0]()]
    t0 = time.monotonic()
    errors = worker.add(seqs)
    assert time.monotonic() - t0 < 0.3  # four 0.1 s opens: add() waited for none of them
    assert errors == [None] * 4  # the refusal comes with a step
    first = worker.step()  # the prefill chunks, while the opens answer one by one
    assert worker.target.pool is not None and worker.target.pool.num_used == 4
    results = run_to_completion(worker)
    for out in first:  # a refusal that answered during the first iteration is reported by it
        results.setdefault(out.seq_id, Finished()).tokens.extend(out.new_token_ids)
        if out.finish_reason is not None:
            results[out.seq_id].finish, results[out.seq_id].error = out.finish_reason, out.error
    assert results["t4"].finish is FinishReason.ERROR and "grammar refused" in results["t4"].error
    assert results["t4"].tokens == []
    assert all(results[f"g{i}"].error is None for i in range(3))
    assert worker.target.pool.num_used == 0  # the refused one's slot was given back too
    assert events.count("open") == 4 and events.index("prefill") < 3, events  # the prefill did not wait for the opens


def _running_worker_with_gated_opens(make_worker):
    """A worker with one unconstrained sequence running (one step taken), whose mask session
    opens from now on wait for the returned gate (the real open, released by ``gate.set()``)."""
    import threading

    worker = make_worker()
    assert worker.add([_seq("running", max_tokens=40, grammar=None, speculation=SpeculationParams(k=0))]) == [None]
    worker.step()
    router = worker.masks._router
    real_open = router.open_session_info
    gate = threading.Event()

    def gated_open(*args, **kwargs):
        gate.wait(10)
        return real_open(*args, **kwargs)

    router.open_session_info = gated_open
    return worker, gate


def test_a_sequence_sits_out_steps_until_its_session_opens(make_worker, mask_service):
    """A new grammar sequence whose session is slow to open does not hold up the running ones:
    they step without it, and it joins once its session is open. Removed while its session is
    still opening, it leaves no session behind."""

    worker, gate = _running_worker_with_gated_opens(make_worker)
    assert worker.add([_seq("late", max_tokens=4), _seq("gone", max_tokens=4)]) == [None, None]
    for _ in range(3):
        assert [out.seq_id for out in worker.step()] == ["running"]  # the others sit out
    worker.remove(["gone"])
    gate.set()
    results = run_to_completion(worker)
    assert results["late"].error is None and results["late"].tokens
    assert "gone" not in results
    # Its first output says what the wait cost: the three steps above, and those "running"
    # took while the released open (a compile, on another thread) finished.
    first, *rest = results["late"].outputs
    assert first.session_wait in (SessionWait.SAT_OUT, SessionWait.JOINED_LATE)
    assert first.steps_sat_out >= 3
    assert all(out.session_wait is None for out in rest)
    assert all(out.session_wait is None for out in results["running"].outputs)  # no grammar: nothing to report
    assert wait_sessions_closed(mask_service, ["late", "gone"]) == 0  # "gone"'s was closed once it opened


def test_a_sequence_whose_session_opens_while_the_step_proposes_joins_that_step(make_worker):
    """A session that answers after the step began, while the drafts are proposed, lets its
    sequence join that step's verify forward with no drafts (one token, its prompt fed), not
    sit the step out; the greedy output is the same as with the session open from the start."""
    worker, gate = _running_worker_with_gated_opens(make_worker)
    assert worker.add([_seq("late", max_tokens=6)]) == [None]
    drafter = worker.stepper.drafter
    real_propose = drafter.propose
    began_with: list[list[str]] = []

    def propose(slots, errors, **options):
        began_with.append([s.seq.seq_id for s in slots])
        gate.set()  # the open answers while this step proposes
        worker._seqs["late"].session_opening.result(timeout=10)
        return real_propose(slots, errors, **options)

    drafter.propose = propose
    first = {out.seq_id: out for out in worker.step()}
    drafter.propose = real_propose
    assert began_with == [["running"]]  # "late" was still opening when the step began
    assert set(first) == {"running", "late"}
    late = first["late"]
    assert late.error is None and late.drafts_proposed == 0 and late.target_forwards == 1
    assert len(late.new_token_ids) == 1
    assert late.session_wait is SessionWait.JOINED_LATE and late.steps_sat_out == 0
    tokens = late.new_token_ids + run_to_completion(worker)["late"].tokens

    reference = make_worker()
    assert reference.add([_seq("late", max_tokens=6)], wait_for_sessions=True) == [None]
    done = run_to_completion(reference)["late"]
    assert tokens == done.tokens
    assert done.outputs[0].session_wait is SessionWait.READY and done.outputs[0].steps_sat_out == 0


def test_add_can_wait_for_the_sessions(make_worker):
    """``wait_for_sessions``: add() reports every session refusal itself (what benchmarks use)."""
    worker = make_worker()
    errors = worker.add([_seq("ok", max_tokens=4), BAD["bad grammar"][0]()], wait_for_sessions=True)
    assert errors[0] is None and errors[1] is not None and "grammar refused" in errors[1]
    assert worker.active_ids() == ["ok"] and worker._seqs["ok"].session_id is not None
    assert run_to_completion(worker)["ok"].error is None
