"""The engine's placement (orchestrator.placement.Placer, ClientLedger) on real requests and
worker slots: least-loaded healthy worker with room, fair between clients, the queue's order
kept when the head does not fit, and a changed config applied at once."""

from __future__ import annotations

import collections
import time

import pytest

from specmask.gpu_worker.kv_budget import KVBudget
from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams, WorkerInfo
from specmask.orchestrator.engine_config import EngineConfig
from specmask.orchestrator.placement import ClientLedger, Placer, free_slots, kv_usage
from specmask.orchestrator.request import Request
from specmask.orchestrator.token_admission import PromptTokenBounds
from specmask.orchestrator.worker_slot import WorkerSlot

INFO = WorkerInfo(
    vocab_size=64, max_model_len=256, tokenizer_id="t", eos_token_ids=(0,), device="cpu", has_draft_model=False, max_k=4
)


def _config(**kw) -> EngineConfig:
    return EngineConfig(max_queue=100, step_timeout_s=30.0, validation_threads=1, **kw)


def _slot(index: int, capacity: int = 4, info: WorkerInfo = INFO) -> WorkerSlot:
    # The placer never calls the actor: placement is engine-side state only.
    return WorkerSlot(index=index, actor=None, info=info, capacity=capacity)


class _Engine:
    """The containers the engine shares with its placer."""

    def __init__(self, tokenizer, slots: list[WorkerSlot]) -> None:
        self.tokenizer = tokenizer
        self.slots = slots
        self.waiting: collections.deque[Request] = collections.deque()
        self.slot_of: dict[str, WorkerSlot] = {}
        self.live: dict[str, Request | None] = {}
        self.placer = Placer(self.waiting, self.slots, self.slot_of, self.live)

    def queue(self, rid: str, client: str = "", prompt: int = 3, max_tokens: int = 8, k: int = 0) -> Request:
        seq = NewSequence(
            rid,
            tuple(range(1, prompt + 1)),
            None,
            sampling=SamplingParams(max_tokens=max_tokens),
            speculation=SpeculationParams(enabled=k > 0, k=k),
        )
        request = Request(seq, tokenizer=self.tokenizer)
        self.live[rid] = request
        self.placer.clients.admit(rid, client)
        self.waiting.append(request)
        return request

    def where(self, request: Request) -> int | None:
        slot = self.slot_of.get(request.request_id)
        return None if slot is None else slot.index


def test_requests_go_to_the_least_loaded_healthy_worker_and_wake_it(bpe_tokenizer) -> None:
    eng = _Engine(bpe_tokenizer, [_slot(0), _slot(1), _slot(2)])
    eng.slots[1].healthy = False
    placed = [eng.queue(f"r{i}") for i in range(4)]
    eng.placer.place(_config(fair_placement=False))
    assert [eng.where(r) for r in placed] == [0, 2, 0, 2]
    assert not eng.waiting and not eng.slots[1].to_add
    assert eng.slots[0].wake.is_set() and not eng.slots[1].wake.is_set()
    assert free_slots(eng.slots) == 4  # two healthy workers of 4, four placed


def test_a_full_batch_leaves_requests_queued_in_order(bpe_tokenizer) -> None:
    eng = _Engine(bpe_tokenizer, [_slot(0, capacity=2)])
    placed = [eng.queue(f"r{i}") for i in range(5)]
    eng.placer.place(_config(fair_placement=False))
    assert [eng.where(r) for r in placed] == [0, 0, None, None, None]
    assert list(eng.waiting) == placed[2:]
    assert free_slots(eng.slots) == 0


def test_a_head_that_does_not_fit_is_not_overtaken(bpe_tokenizer) -> None:
    """Per-worker prompt-token bound: the long head waits, and the short ones behind it wait too."""
    eng = _Engine(bpe_tokenizer, [_slot(0, capacity=8)])
    first = eng.queue("first", prompt=60)
    long = eng.queue("long", prompt=60)
    short = eng.queue("short", prompt=2)
    eng.placer.place(_config(fair_placement=False, prompt_token_bounds=PromptTokenBounds(0, 100)))
    assert (eng.where(first), eng.where(long), eng.where(short)) == (0, None, None)


def test_kv_budget_bounds_placement_and_usage(bpe_tokenizer) -> None:
    budget = KVBudget(positions=256, max_model_len=100, slack=0, min_capacity=1)
    info = WorkerInfo(**{**INFO.__dict__, "max_model_len": 100, "kv_budget": budget})
    eng = _Engine(bpe_tokenizer, [_slot(0, capacity=8, info=info)])
    assert kv_usage(eng.slots) == 0.0
    placed = [eng.queue(f"r{i}", prompt=20, max_tokens=80) for i in range(3)]  # 100 positions each
    eng.placer.place(_config(fair_placement=False))
    assert [eng.where(r) for r in placed] == [0, 0, None]  # a third would reserve 300 > 256
    assert kv_usage(eng.slots) == pytest.approx(200 / 256)
    assert kv_usage([_slot(1)]) is None  # no budget: no gauge


def test_fair_placement_alternates_clients_and_a_config_change_applies_at_once(bpe_tokenizer) -> None:
    eng = _Engine(bpe_tokenizer, [_slot(0, capacity=4)])
    flood = [eng.queue(f"a{i}", client="a") for i in range(4)]
    other = [eng.queue(f"b{i}", client="b") for i in range(2)]
    eng.placer.place(_config(fair_placement=True))
    # Two clients with work share 4 slots: 2 each, the flood's arrival order notwithstanding.
    assert [eng.where(r) for r in flood] == [0, 0, None, None]
    assert [eng.where(r) for r in other] == [0, 0]
    # Strict arrival order once fairness is off; nothing is moved that has been placed.
    eng2 = _Engine(bpe_tokenizer, [_slot(0, capacity=4)])
    flood2 = [eng2.queue(f"a{i}", client="a") for i in range(4)]
    other2 = [eng2.queue(f"b{i}", client="b") for i in range(2)]
    eng2.placer.place(_config(fair_placement=False))
    assert [eng2.where(r) for r in flood2] == [0, 0, 0, 0]
    assert [eng2.where(r) for r in other2] == [None, None]


def test_ledger_counts_per_client_and_lingers() -> None:
    ledger = ClientLedger()
    ledger.admit("r1", "alice")
    ledger.admit("r2", "alice")
    ledger.admit("r3", "")  # no client named: counted nowhere
    assert ledger.in_flight("alice") == 2 and ledger.in_flight("") == 0
    assert ledger.client_of("r1") == "alice" and ledger.client_of("r3") == ""
    assert ledger.release("r1") is False  # alice still has r2
    assert ledger.release("r3") is False and ledger.release("unknown") is False
    assert ledger.release("r2") is True  # alice's last one
    assert ledger.release("r2") is False  # idempotent
    assert ledger.in_flight("alice") == 0
    assert ledger.with_work([], linger_s=60.0) == {"alice"}  # lingering
    assert ledger.with_work([], linger_s=0.0) == set()  # and dropped once the linger is over
    assert ledger.with_work([], linger_s=60.0) == set()
    ledger.admit("r4", "bob")
    assert ledger.with_work(["r4", "r5"], linger_s=0.0) == {"bob", ""}


def test_ledger_linger_ends_by_the_clock() -> None:
    ledger = ClientLedger()
    ledger.admit("r1", "carol")
    ledger.release("r1")
    time.sleep(0.05)
    assert ledger.with_work([], linger_s=0.01) == set()
