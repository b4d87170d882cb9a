"""The worker's request checks (gpu_worker.admission), without models: every refusal names
what is wrong, the state of an accepted request is what the step loop expects, and seeds
are drawn reproducibly. The worker-level behaviour (refusals while serving) is
tests/gpu_worker/test_bad_requests.py."""

from __future__ import annotations

import math

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.proposer_kind import ProposerKind
from specmask.gpu_worker.admission import SEED_BITS, Admission, WorkerLimits
from specmask.gpu_worker.kv_budget import KVBudget
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams

LIMITS = WorkerLimits(
    vocab_size=300,
    max_model_len=64,
    max_batch=3,
    max_k=4,
    eos_token_ids=(2,),
    proposers=frozenset({ProposerKind.DRAFT_MODEL, ProposerKind.NGRAM}),
    draft_vocab_size=200,
    has_mask_service=False,
)
GRAMMAR = GrammarSpec(GrammarKind.REGEX, "(yes|no)")


def _seq(seq_id: str = "s", prompt: tuple[int, ...] = (5, 6), **sampling: object) -> NewSequence:
    spec = sampling.pop("speculation", SpeculationParams(k=2, proposers=(ProposerKind.NGRAM,)))
    assert isinstance(spec, SpeculationParams)
    return NewSequence(seq_id, prompt, None, SamplingParams(**sampling), spec)  # type: ignore[arg-type]


def _admit(admission: Admission, req: object, active: dict[str, SequenceState] | None = None) -> SequenceState:
    return admission.admit(req, active or {}, set(), [])


REFUSED = {
    "not a NewSequence": ({"seq_id": "x"}, TypeError, "expected NewSequence"),
    "empty seq_id": (_seq(""), ValueError, "seq_id must be a non-empty string"),
    "empty prompt": (_seq(prompt=()), ValueError, "prompt_token_ids is empty"),
    "id past the vocabulary": (_seq(prompt=(5, 300)), ValueError, "prompt token id 300 outside [0, 300)"),
    "negative id": (_seq(prompt=(-1,)), ValueError, "outside [0, 300)"),
    "bool id": (_seq(prompt=(True,)), ValueError, "prompt token id True"),
    "float id": (_seq(prompt=(5.0,)), ValueError, "prompt token id 5.0"),  # type: ignore[arg-type]
    "prompt fills the context": (_seq(prompt=(5,) * 64), ValueError, "no room below max_model_len 64"),
    "NaN temperature": (_seq(temperature=math.nan), ValueError, "temperature"),
    "infinite temperature": (_seq(temperature=math.inf), ValueError, "temperature"),
    "top_p 0": (_seq(top_p=0.0), ValueError, "top_p"),
    "top_p above 1": (_seq(top_p=1.5), ValueError, "top_p"),
    "negative top_k": (_seq(top_k=-1), ValueError, "top_k"),
    "no output": (_seq(max_tokens=0), ValueError, "max_tokens"),
    "logprobs": (_seq(logprobs=10**6), ValueError, "logprobs"),
    "k past max_k": (_seq(speculation=SpeculationParams(k=5)), ValueError, "speculation k must be in [0, 4]"),
    "unknown proposer": (_seq(speculation=SpeculationParams(proposers=("oracle",))), ValueError, "unknown proposer"),
    "stop id": (NewSequence("s", (5,), None, stop_token_ids=(300,)), ValueError, "stop token id 300"),
    "grammar, no mask service": (NewSequence("s", (5,), GRAMMAR), ValueError, "no mask service configured"),
    "outside the draft vocabulary": (
        _seq(prompt=(5, 250), speculation=SpeculationParams(proposers=(ProposerKind.DRAFT_MODEL,))),
        ValueError,
        "prompt token id 250 is outside the draft vocabulary",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_bad_request_is_refused_with_what_is_wrong(case: str) -> None:
    req, kind, message = REFUSED[case]
    with pytest.raises(kind) as err:
        _admit(Admission(LIMITS, None, seed=0), req)
    assert message in str(err.value)


def test_duplicates_and_a_full_worker_are_refused() -> None:
    admission = Admission(LIMITS, None, seed=0)
    active = {"a": _admit(admission, _seq("a"))}
    with pytest.raises(ValueError, match="duplicate seq_id 'a'"):
        admission.admit(_seq("a"), active, set(), [])
    with pytest.raises(ValueError, match="duplicate seq_id 'b'"):
        admission.admit(_seq("b"), active, {"b"}, [])  # taken earlier in the same add()
    b = admission.admit(_seq("b"), active, set(), [])
    c = admission.admit(_seq("c"), active, {"b"}, [b])
    with pytest.raises(ValueError, match=r"worker is full \(3 active sequences\)"):
        admission.admit(_seq("d"), active, {"b", "c"}, [b, c])


def test_one_adds_requests_are_checked_in_turn(caplog: pytest.LogCaptureFixture) -> None:
    """A batch is checked in order, each request against the held ones and the ones taken
    before it: a refused one takes no slot, a repeated id is refused the second time, and the
    batch stops fitting where the worker fills; every refusal is logged under its request id."""
    admission = Admission(LIMITS, None, seed=0)
    active = {"a": _admit(admission, _seq("a"))}
    bad = NewSequence("bad", (), None, request_id="req-bad")
    batch = [bad, _seq("b"), _seq("b"), _seq("a"), _seq("c"), _seq("d"), {"seq_id": "x"}]
    with caplog.at_level("WARNING", logger="specmask.gpu_worker.admission"):
        errors, accepted = admission.admit_batch(batch, active)
    assert [(i, s.seq_id) for i, s in accepted] == [(1, "b"), (4, "c")]
    assert errors[1] is None and errors[4] is None
    assert errors[0] == "prompt_token_ids is empty"
    assert errors[2] == "duplicate seq_id 'b'" and errors[3] == "duplicate seq_id 'a'"
    assert errors[5] == "worker is full (3 active sequences)"
    assert errors[6] == "expected NewSequence, got dict"
    assert list(active) == ["a"]  # the batch's states are the caller's to hold
    assert "[request_id=req-bad] seq bad refused: prompt_token_ids is empty" in caplog.text
    assert caplog.text.count(" refused: ") == 5


def test_an_accepted_request_starts_as_the_step_loop_expects() -> None:
    admission = Admission(LIMITS, None, seed=0)
    asked = (ProposerKind.GRAMMAR_FORCED, ProposerKind.NGRAM, ProposerKind.DRAFT_MODEL)
    s = _admit(admission, _seq(prompt=(7, 8, 9), speculation=SpeculationParams(k=3, proposers=asked)))
    assert s.token_ids == [7, 8, 9] and s.stop_token_ids == frozenset({2})
    # Only the proposers this worker built, in registry priority order; a draft cache for the draft model.
    assert set(s.proposers) == {ProposerKind.DRAFT_MODEL, ProposerKind.NGRAM} and s.k == 3
    assert s.draft_kv is not None
    plain = _admit(admission, NewSequence("p", (7,), None, stop_token_ids=(4, 5), speculation=SpeculationParams(k=0)))
    assert plain.proposers == () and plain.k == 0 and plain.draft_kv is None
    assert plain.stop_token_ids == frozenset({4, 5})  # the request's stop set replaces EOS
    unbuilt = _admit(admission, _seq(speculation=SpeculationParams(k=2, proposers=(ProposerKind.GRAMMAR_FORCED,))))
    assert unbuilt.proposers == () and unbuilt.k == 0  # nothing asked for is built here: plain decoding


def test_seeds_are_drawn_reproducibly_and_kept_non_negative() -> None:
    one, other = Admission(LIMITS, None, seed=7), Admission(LIMITS, None, seed=7)
    drawn = [_admit(one, _seq(f"s{i}")).seed for i in range(5)]
    assert drawn == [_admit(other, _seq(f"s{i}")).seed for i in range(5)]
    third = Admission(LIMITS, None, seed=8)
    assert drawn != [_admit(third, _seq(f"s{i}")).seed for i in range(5)]  # the worker's seed matters
    assert len(set(drawn)) == 5 and all(0 <= seed < 2**SEED_BITS for seed in drawn)
    assert _admit(one, _seq(seed=12345)).seed == 12345  # the request's own seed
    assert _admit(one, _seq(seed=-1)).seed == 2**SEED_BITS - 1  # folded into the kernels' range


def test_the_kv_budget_refuses_what_would_not_fit() -> None:
    budget = KVBudget(positions=3 * 64, max_model_len=64, slack=8, min_capacity=16)
    admission = Admission(LIMITS, budget, seed=0)
    active: dict[str, SequenceState] = {}
    for name in ("a", "b"):
        active[name] = admission.admit(_seq(name, max_tokens=40), active, set(), [])
    assert admission.need(active["a"]) == budget.need(2, 40)
    with pytest.raises(ValueError, match="KV budget full: 3 sequences would reserve"):
        admission.admit(_seq("c", max_tokens=1000), active, set(), [])
    assert admission.admit(_seq("c", max_tokens=4), active, set(), []).seq_id == "c"
