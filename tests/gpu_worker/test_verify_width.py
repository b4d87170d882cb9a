"""The verify-width choice: per row, trims long low-confidence draft tails, keeps drafts that pay."""

from __future__ import annotations

from specmask.gpu_worker.proposers.base import DraftSlot, Proposal
from specmask.gpu_worker.sequence import SequenceState
from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams
from specmask.gpu_worker.verify_width import FIXED_POSITIONS, GPU_FIXED_POSITIONS, WidthChooser


def _slot(sources: list[str]) -> DraftSlot:
    seq = SequenceState(
        request=NewSequence(
            seq_id="s",
            prompt_token_ids=(1, 2),
            grammar=None,
            sampling=SamplingParams(max_tokens=8),
            speculation=SpeculationParams(enabled=True, k=4),
        ),
        stop_token_ids=frozenset(),
        proposers=("ngram",),
        k=4,
        seed=0,
        token_ids=[1, 2],
    )
    slot = DraftSlot(seq, k=len(sources))
    for i, source in enumerate(sources):
        slot.add(Proposal(10 + i), source)
    return slot


def _learn(chooser: WidthChooser, source: str, accepted_of_four: int, times: int = 200) -> None:
    for _ in range(times):
        chooser.record(_slot([source] * 4), accepted_of_four)


def test_an_unlikely_tail_is_trimmed_to_the_minimum() -> None:
    chooser = WidthChooser()
    _learn(chooser, "ngram", 0)  # n-gram drafts are never accepted
    _learn(chooser, "grammar_forced", 4)  # forced drafts always are
    slots = [_slot(["grammar_forced"]) for _ in range(8)] + [_slot(["ngram"] * 4)]
    assert chooser.choose(slots) == [1] * 9  # still one draft where one was proposed
    assert chooser.trim(slots) == 3
    assert [len(s.drafts) for s in slots] == [1] * 9
    assert slots[-1].sources == ["ngram"] and slots[-1].q_rows == [None]


def test_each_row_keeps_the_drafts_that_pay_for_it() -> None:
    """Per-row widths: a row of sure drafts keeps all four beside rows whose tails are cut."""
    chooser = WidthChooser()
    _learn(chooser, "grammar_forced", 4)
    _learn(chooser, "ngram", 1)  # only the first n-gram draft is accepted
    slots = [_slot(["grammar_forced"] * 4)] + [_slot(["ngram"] * 4) for _ in range(8)] + [_slot([])]
    assert chooser.choose(slots) == [4] + [1] * 8 + [0]
    assert chooser.trim(slots) == 8 * 3


def test_drafts_that_are_accepted_keep_their_width() -> None:
    chooser = WidthChooser()
    _learn(chooser, "ngram", 4)
    slots = [_slot(["ngram"] * 4) for _ in range(9)]
    assert chooser.choose(slots) == [4] * 9
    assert chooser.trim(slots) == 0


def test_the_choice_maximises_expected_tokens_per_cost() -> None:
    """Brute force over every per-row count (at least one draft each) on a mixed batch."""
    import itertools

    chooser = WidthChooser(fixed_positions=6.0)
    _learn(chooser, "ngram", 2, times=3)  # rates well inside (0, 1)
    _learn(chooser, "draft_model", 1, times=2)
    slots = [_slot(["ngram"] * 4), _slot(["draft_model"] * 3), _slot(["ngram", "draft_model"]), _slot([])]

    def value(keep: tuple[int, ...]) -> float:
        expected = float(len(slots))
        for s, k in zip(slots, keep):
            chance = 1.0
            for j, source in enumerate(s.sources[:k], start=1):
                chance *= chooser.pricing_rate(source, j)
                expected += chance
        return expected / (chooser.fixed_positions + len(slots) + sum(keep))

    options = [range(min(1, len(s.drafts)), len(s.drafts) + 1) for s in slots]
    best = max(value(keep) for keep in itertools.product(*options))
    got = chooser.choose(slots)
    assert abs(value(tuple(got)) - best) < 1e-12


def test_acceptance_is_learned_by_depth() -> None:
    chooser = WidthChooser()
    _learn(chooser, "ngram", 2)
    assert chooser.rate("ngram", 1) > 0.95 and chooser.rate("ngram", 2) > 0.95
    assert chooser.rate("ngram", 3) < 0.05
    assert ("ngram", 4) not in chooser.stats  # never reached: nothing learned


def test_trim_keeps_the_mask_rows_of_kept_drafts() -> None:
    slot = _slot(["ngram"] * 3)
    slot.grammar_rows.extend(["M0", "M1", "M2", "M3"])  # type: ignore[list-item]  # markers, never read as rows
    assert slot.trim(1) == 2
    assert slot.drafts == [10] and slot.grammar_rows == ["M0", "M1"]
    assert slot.trim(5) == 0


def test_a_trimmed_depth_is_tried_again_later() -> None:
    chooser = WidthChooser()
    _learn(chooser, "ngram", 1)  # only the first n-gram draft is accepted
    assert chooser.trim([_slot(["ngram"] * 4) for _ in range(9)]) == 27  # verified one each
    for _ in range(300):  # steps that never verify depth 2: its estimate fades to the prior
        chooser.trim([_slot(["ngram"])])
    assert 0.4 < chooser.rate("ngram", 2) < 0.6


def test_an_unmeasured_depth_is_verified_at_a_large_batch() -> None:
    """At 32 rows the kept set's E / cost (about 0.6) beats the prior's gain (0.5): priced at the
    prior, depth 2 would never be verified, so never measured, whatever the drafts are worth.
    Unmeasured, it is priced as sure; measured bad, it is trimmed; faded, it is tried again."""
    chooser = WidthChooser()
    for _ in range(200):  # depth 1 always accepted; deeper drafts never verified
        chooser.record(_slot(["ngram"]), 1)
    batch = [_slot(["ngram"] * 4) for _ in range(32)]
    assert chooser.choose(batch) == [4] * 32
    _learn(chooser, "ngram", 1)  # measured: only the first draft is ever accepted
    assert chooser.choose(batch) == [1] * 32
    for _ in range(300):  # steps that verify depth 1 only: depth 2's count fades
        chooser.trim([_slot(["ngram"])])
        chooser.record(_slot(["ngram"]), 1)
    assert chooser.choose(batch) == [4] * 32


def test_a_gpu_keeps_drafts_a_cpu_trims() -> None:
    """The fixed cost by device: a forward's weights read dwarfs a position on a GPU."""
    cpu, gpu = WidthChooser.for_device("cpu"), WidthChooser.for_device("cuda")
    assert (cpu.fixed_positions, gpu.fixed_positions) == (FIXED_POSITIONS, GPU_FIXED_POSITIONS)
    for chooser in (cpu, gpu):
        for accepted in (0, 1, 2, 3) * 50:  # each depth accepted about half the time
            chooser.record(_slot(["draft_model"] * 4), accepted)
    batch = [_slot(["draft_model"] * 4) for _ in range(32)]
    assert cpu.choose(batch) == [1] * 32
    assert min(gpu.choose(batch)) >= 2
