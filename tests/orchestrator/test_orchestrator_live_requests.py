"""LiveRequests (live_requests.py): where each live request is and every way one ends or goes back
in line, on real Requests, real placement (``Placer``) and real metrics; the workers are engine-side
slots only (no call is made to one here, so their actors are opaque handles)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, StepOutput, WorkerInfo
from specmask.orchestrator.checked_retry import SEED_STRIDE
from specmask.orchestrator.engine_config import EngineConfig
from specmask.orchestrator.errors import DuplicateRequestId, Overloaded
from specmask.orchestrator.live_requests import LiveRequests
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.request import Request
from specmask.orchestrator.types import GenerationRequest, GrammarReport
from specmask.orchestrator.worker_slot import WorkerSlot

INFO = WorkerInfo(
    vocab_size=512, max_model_len=64, tokenizer_id="t", eos_token_ids=(0,), device="cpu", has_draft_model=False, max_k=2
)


class Book:
    """A LiveRequests over ``n`` slots of ``capacity``, placing as the engine does after each change."""

    def __init__(self, tokenizer, n: int = 1, capacity: int = 2, **config) -> None:
        self.tokenizer = tokenizer
        self.slots = [WorkerSlot(index=i, actor=f"actor-{i}", info=INFO, capacity=capacity) for i in range(n)]
        self.metrics = OrchestratorMetrics(CollectorRegistry())
        self.config = EngineConfig(max_queue=8, step_timeout_s=5.0, validation_threads=1, **config)
        self.placements = 0
        self.requests = LiveRequests(self.slots, self.metrics, lambda: self.config, self.place)

    def place(self) -> None:
        self.placements += 1
        self.requests.placer.place(self.config)

    def admit(
        self, rid: str, client: str = "", seed: int | None = None, grammar: GrammarReport | None = None
    ) -> Request:
        sampling = SamplingParams(seed=seed)
        self.requests.reserve(GenerationRequest(request_id=rid, prompt="p", sampling=sampling, client=client))
        seq = NewSequence(rid, (1, 2, 3), None, sampling)
        request = Request(seq, tokenizer=self.tokenizer, grammar=grammar, max_attempts=3)
        self.requests.enqueue(request)
        self.place()
        return request

    def send(self, slot: WorkerSlot) -> None:
        """What the step loop does with a slot's placed requests: send them (they run)."""
        for request in slot.to_add:
            slot.running[request.request_id] = request
        slot.to_add.clear()

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


def test_reserve_refuses_a_live_id_and_a_client_past_its_cap(bpe_tokenizer) -> None:
    book = Book(bpe_tokenizer, max_inflight_per_client=2)
    book.admit("a", client="alice")
    with pytest.raises(DuplicateRequestId):
        book.admit("a", client="bob")
    book.requests.reserve(GenerationRequest(request_id="b", prompt="p", client="alice"))  # validating
    with pytest.raises(Overloaded, match="2 requests in flight"):
        book.requests.reserve(GenerationRequest(request_id="c", prompt="p", client="alice"))
    book.requests.reserve(GenerationRequest(request_id="c", prompt="p", client="bob"))  # others are not held up
    assert len(book.requests) == 3 and book.requests.unfinished() == [book.requests.live["a"]]
    book.requests.unreserve("b")  # refused in validation: its id and its client's count are free again
    book.requests.reserve(GenerationRequest(request_id="b", prompt="p", client="alice"))
    assert len(book.requests) == 3


def test_cancel_frees_a_request_wherever_it_is(bpe_tokenizer) -> None:
    book = Book(bpe_tokenizer, capacity=2)
    (slot,) = book.slots
    running, placed = book.admit("running"), book.admit("running-2")
    book.send(slot)
    placed = book.admit("placed")  # no room: it waits
    waiting = book.admit("waiting")
    assert [r.request_id for r in book.requests.waiting] == ["placed", "waiting"]
    book.requests.cancel("waiting")
    assert not book.requests.waiting.count(waiting) and waiting.finish_reason is FinishReason.CANCELLED
    slot.wake.clear()
    book.requests.cancel("running", FinishReason.ERROR, "server shutting down")
    # Sent to the worker: it frees it on its next iteration, and the freed slot is refilled at once.
    assert slot.to_remove == ["running"] and slot.wake.is_set() and running.error == "server shutting down"
    assert slot.to_add == [placed] and book.requests.slot_of["placed"] is slot
    book.requests.cancel("placed")  # placed but never sent: nothing for the worker to free
    assert slot.to_add == [] and slot.to_remove == ["running"] and "placed" not in book.requests.slot_of
    assert set(book.requests.live) == {"running-2"}
    book.requests.cancel("placed")  # finished or unknown: a no-op
    book.requests.cancel("nobody")
    assert book.sample("specmask_requests_total", finish_reason="cancelled") == 2
    slot.wake.clear()
    book.requests.cancel("running-2")  # nothing waits to take its place: the cancel itself wakes the loop
    assert slot.to_remove == ["running", "running-2"] and slot.wake.is_set() and len(book.requests) == 0


def test_a_lost_worker_requeues_what_had_not_started_and_fails_the_rest(bpe_tokenizer) -> None:
    book = Book(bpe_tokenizer, n=2, capacity=4)
    lost, other = book.slots
    other.healthy = False  # only `lost` takes requests while they are placed
    a, b1, b2 = book.admit("a"), book.admit("b1"), book.admit("b2")
    book.send(lost)
    d = book.admit("d")  # placed, not sent yet
    book.admit("x")  # fills it
    c = book.admit("c")  # waits: `lost` is full
    a.apply_step(StepOutput("a", [5, 6]))  # a has streamed tokens; the others have not
    lost.healthy = False
    lost.to_remove.append("gone")
    book.requests.worker_lost(lost, "died")
    assert a.finish_reason is FinishReason.ERROR and a.error == "GPU worker 0 died; the request was cut off"
    assert not lost.running and not lost.to_add and not lost.to_remove
    # Back at the head of the line, in the order they were placed, ahead of the one that waited.
    assert [r.request_id for r in book.requests.waiting] == ["b1", "b2", "d", "x", "c"]
    assert not book.requests.slot_of and len(book.requests) == 5
    assert book.sample("specmask_requeued_requests_total") == 2  # b1, b2 (d and x had not been sent)
    other.healthy = True
    book.place()
    assert other.to_add == [b1, b2, d, book.requests.live["x"]] and list(book.requests.waiting) == [c]


def test_fail_batch_and_fail_waiting_end_requests_with_the_message(bpe_tokenizer) -> None:
    book = Book(bpe_tokenizer, capacity=1)
    (slot,) = book.slots
    sent = book.admit("sent")
    book.send(slot)
    queued = book.admit("queued")
    slot.healthy = False  # nothing is placed again while the batch fails
    book.requests.fail_batch(slot, "worker call failed: boom")
    assert sent.finish_reason is FinishReason.ERROR and sent.error == "worker call failed: boom"
    assert slot.to_remove == ["sent"] and not slot.running
    book.requests.fail_waiting("no GPU worker is available")
    assert queued.error == "no GPU worker is available" and not book.requests.waiting and len(book.requests) == 0


def test_resample_puts_the_request_first_in_line_with_the_next_seed(bpe_tokenizer) -> None:
    book = Book(bpe_tokenizer, capacity=1)
    (slot,) = book.slots
    checked = book.admit("checked", seed=11, grammar=GrammarReport("checked", "xgrammar", relaxed=("uniqueItems",)))
    book.send(slot)
    book.admit("behind")
    checked.apply_step(StepOutput("checked", [5, 6], finish_reason=FinishReason.GRAMMAR_COMPLETE))
    del slot.running["checked"]  # the worker reported it complete and freed it
    book.requests.resample(checked, "the output is not valid")
    assert checked.attempts == 2 and checked.seq.sampling.seed == (11 + SEED_STRIDE) % 2**63 and not checked.token_ids
    assert slot.to_add == [checked] and [r.request_id for r in book.requests.waiting] == ["behind"]


def test_a_clients_last_request_places_again_once_its_share_stops_lingering(bpe_tokenizer) -> None:
    async def go() -> None:
        book = Book(bpe_tokenizer, fair_share_linger_s=0.05)
        book.admit("a", client="alice")
        book.requests.cancel("a")
        placed = book.placements
        await asyncio.sleep(0.5)  # the linger's timer is on the loop, however slow the machine
        assert book.placements == placed + 1

    asyncio.run(go())


def test_a_changed_config_applies_at_once(bpe_tokenizer) -> None:
    book = Book(bpe_tokenizer)
    book.admit("a", client="alice")
    book.config = dataclasses.replace(book.config, max_inflight_per_client=1)
    with pytest.raises(Overloaded):
        book.admit("b", client="alice")
