"""The worker refuses bad requests with a clear message and keeps serving."""

from __future__ import annotations

import pytest

from gpu_worker.actor import UnknownSequenceError
from gpu_worker.types import FinishReason, NewSequence, SamplingParams, SpeculationParams
from mask_service.grammar import GrammarKind, GrammarSpec
from tests.gpu_worker.helpers import run_to_completion

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


def test_bad_requests_get_per_sequence_errors_and_worker_keeps_serving(make_worker):
    worker = make_worker()
    assert worker.add([_seq("good", max_tokens=10)]) == [None]
    names = list(BAD)
    errors = worker.add([BAD[n][0]() for n in names] + [_seq("good2", max_tokens=10)])
    for name, err in zip(names, errors):
        assert err is not None and BAD[name][1] in err, (name, err)
    assert errors[-1] is None
    # Duplicate ids: against an active sequence, and within one call.
    dup = worker.add([_seq("good"), _seq("new"), _seq("new")])
    assert "duplicate" in dup[0] and dup[1] is None and "duplicate" in dup[2]
    assert worker.num_active() == 3
    with pytest.raises(UnknownSequenceError, match="nope"):
        worker.remove(["new", "nope"])
    assert worker.num_active() == 2  # "new" was removed despite the unknown id
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
    assert errors[0] is not None and "mask service" in errors[0] and errors[1] is None
    assert run_to_completion(worker)["plain"].tokens


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
    from mask_service.config import MaskServiceConfig
    from mask_service.server import build_service
    from mask_service.tokenizers import TokenizerSource

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
    """add() opens the mask sessions on the I/O thread while the prompts prefill (before, one
    round trip after another in front of the prefill); a sequence whose session is refused was
    prefilled meanwhile, and its KV slot is given back. (``step_prefill_tokens=1``: these short
    prompts would otherwise be fed by the first step, with no prefill in add() at all.)"""
    import threading
    import time

    worker = make_worker(step_prefill_tokens=1)
    events: list[str] = []
    lock = threading.Lock()
    router = worker.masks._router
    real_open, real_prefill = router.open_session, worker._prefill

    def slow_open(*args, **kwargs):
        with lock:
            events.append("open")
        time.sleep(0.1)  # a replica's round trip, slowed so the order is unambiguous
        return real_open(*args, **kwargs)

    def prefill(states):
        with lock:
            events.append("prefill")
        real_prefill(states)

    router.open_session = slow_open
    worker._prefill = prefill
    seqs = [_seq(f"g{i}", max_tokens=4) for i in range(3)] + [BAD["bad grammar"][0]()]
    errors = worker.add(seqs)
    assert errors[:3] == [None] * 3 and errors[3] is not None and "grammar" in errors[3]
    assert events.index("prefill") < len(events) - 1, events  # the prefill did not wait for every open
    assert worker.num_active() == 3
    assert worker.target.pool is not None and worker.target.pool.num_used == 3  # the refused one's slot is free
    results = run_to_completion(worker)
    assert all(r.error is None for r in results.values())
    assert worker.target.pool.num_used == 0
