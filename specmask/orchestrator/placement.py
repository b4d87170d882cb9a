"""Fair placement: which waiting request takes the next free batch slot.

Shared round-robin between end clients (``GenerationRequest.client``): the next request
placed is the oldest waiting one of the client holding the fewest batch slots. And while
several clients have work, none holds more than its *share* of the batch: of the slots, and of
the per-iteration tokens (a sequence speculating ``k`` drafts puts up to ``k + 1`` rows into
each step, out of the worker's iteration budget, gpu_worker.config.iteration_budget; past the
budget the worker trims every sequence's drafts). A share caps placement, not what runs:
requests already in the batch finish, and the client's others are not placed past the share
until it is back within it.

Why the batch and not only the queue: on a CPU (and on a GPU past its memory-bound regime) a
step's cost grows with the rows it verifies, so a flood holding most of the batch makes every
step of another client's request slower, however soon that request was placed. Capping the
flood at its share bounds the batch the other client's steps run in. The price is that a
lone-but-for-a-trickle client leaves slots idle: the trickle's share is kept for it while it
has work (and briefly after, ``EngineConfig.fair_share_linger_s``: a client sending requests
one after another has no work for the moment between them).

A client alone keeps all but a reserve of the slots (``RESERVED_SLOT_FRACTION``; none below 8
slots), so a second client's first request is placed at once instead of waiting for one of the
first's to end.

``Placer`` applies this to the engine's queue: it moves waiting requests onto the least-loaded
healthy worker with room (batch slots, prompt tokens, KV memory); ``ClientLedger`` counts each
client's requests in flight (the per-client cap, and who has work). See docs/design.md,
"Who runs what".
"""

from __future__ import annotations

import collections
import math
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from specmask.gpu_worker.config import CPU_ITERATION_TOKENS, GPU_ITERATION_TOKENS
from specmask.gpu_worker.kv_budget import KVBudget
from specmask.orchestrator.engine_config import EngineConfig
from specmask.orchestrator.request import Request
from specmask.orchestrator.worker_slot import WorkerSlot

# Batch slots (all healthy workers together, rounded down: none below 8) kept from a client that
# is alone, so another client's request is placed at once: the price is this fraction of a lone
# client's batch, the gain that a second client does not wait for one of a flood's requests to end.
RESERVED_SLOT_FRACTION = 1 / 8
# A client alone has no cap on rows: past the iteration budget the worker trims drafts, and
# capping a lone client's batch by the budget would idle slots no one else wants.
UNCAPPED_ROWS = sys.maxsize

T = TypeVar("T")


@dataclass(frozen=True)
class BatchLoad:
    """Batch slots and per-step verify rows (sum of k + 1 over the sequences) held or available."""

    slots: int = 0
    rows: int = 0

    def plus(self, rows: int) -> BatchLoad:
        return BatchLoad(self.slots + 1, self.rows + rows)


def step_rows(k: int) -> int:
    """Rows one sequence speculating ``k`` drafts adds to each step, at most (its verify width)."""
    return max(0, k) + 1


def client_share(capacity: BatchLoad, clients_with_work: int) -> BatchLoad:
    """What one client may hold. Alone: every slot but the reserve, rows uncapped. With ``n``
    clients: 1/n of the slots and of the rows, rounded up (so the shares cover the batch)."""
    if clients_with_work <= 1:
        return BatchLoad(capacity.slots - int(capacity.slots * RESERVED_SLOT_FRACTION), UNCAPPED_ROWS)
    n = clients_with_work
    return BatchLoad(math.ceil(capacity.slots / n), math.ceil(capacity.rows / n))


def within_share(held: BatchLoad, rows: int, share: BatchLoad) -> bool:
    """Whether a request adding ``rows`` keeps its client within ``share``. A client holding
    nothing may always place one request (a request wider than a share still runs, alone)."""
    if held.slots == 0:
        return share.slots > 0
    after = held.plus(rows)
    return after.slots <= share.slots and after.rows <= share.rows


def next_to_place(waiting: Iterable[tuple[T, str, int]], held: Mapping[str, BatchLoad], share: BatchLoad) -> T | None:
    """The request to place next from ``waiting`` ((request, client, rows), oldest first): the
    oldest of the client holding the fewest slots among those it keeps within ``share``; None
    when no waiting client may place another."""
    best: T | None = None
    best_slots = math.inf
    seen: set[str] = set()
    for request, client, rows in waiting:
        if client in seen:
            continue
        seen.add(client)
        load = held.get(client, BatchLoad())
        if load.slots < best_slots and within_share(load, rows, share):
            best, best_slots = request, load.slots
            if best_slots == 0:
                break
    return best


def request_rows(request: Request) -> int:
    """Rows ``request`` adds to each step of its worker, at most."""
    spec = request.seq.speculation
    return step_rows(spec.k if spec.enabled else 0)


def iteration_rows(slot: WorkerSlot, max_iteration_tokens: int) -> int:
    """The rows one iteration of ``slot``'s worker takes before it trims drafts (its budget,
    gpu_worker.config.iteration_budget; 0 = by device), or its full batch's rows when fewer."""
    budget = max_iteration_tokens
    if budget <= 0:
        budget = GPU_ITERATION_TOKENS if slot.info.device.startswith("cuda") else CPU_ITERATION_TOKENS
    return min(budget, slot.capacity * step_rows(slot.info.max_k))


def kv_needs(slot: WorkerSlot, budget: KVBudget) -> list[int]:
    """Positions per slot each request placed on ``slot`` reserves (gpu_worker.kv_budget): the
    worker holds a superset of them at each add(), which removes before it adds."""
    return [
        budget.need(len(r.seq.prompt_token_ids), r.seq.sampling.max_tokens)
        for r in (*slot.running.values(), *slot.to_add)
    ]


def kv_fits(slot: WorkerSlot, request: Request) -> bool:
    """Whether ``request`` fits ``slot``'s KV budget beside what is placed there (no budget: yes)."""
    budget = slot.info.kv_budget
    if budget is None:
        return True
    needs = kv_needs(slot, budget)
    needs.append(budget.need(len(request.seq.prompt_token_ids), request.seq.sampling.max_tokens))
    return budget.fits(needs)


def kv_usage(slots: Iterable[WorkerSlot]) -> float | None:
    """The fraction of the healthy workers' KV positions the placed requests reserve (None: no
    worker has a KV budget)."""
    budgeted = [(s, s.info.kv_budget) for s in slots if s.healthy and s.info.kv_budget is not None]
    if not budgeted:
        return None
    reserved = sum(budget.reserved(kv_needs(s, budget)) for s, budget in budgeted)
    return reserved / sum(budget.positions for _, budget in budgeted)


def free_slots(slots: Iterable[WorkerSlot]) -> int:
    """Batch slots on workers in placement not yet taken by a running or placed request."""
    return sum(max(0, s.capacity - s.load) for s in slots if s.placeable)


class ClientLedger:
    """Live requests per end client (``GenerationRequest.client``; '' = none named), and when each
    client's last one ended: the per-client cap and the clients that share the batch."""

    def __init__(self) -> None:
        self._client_of: dict[str, str] = {}  # request id -> its client, while live
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._idle_since: dict[str, float] = {}  # client -> when its last live request ended (monotonic)

    def in_flight(self, client: str) -> int:
        return self._in_flight[client]

    def client_of(self, request_id: str) -> str:
        return self._client_of.get(request_id, "")

    def admit(self, request_id: str, client: str) -> None:
        """Count ``request_id`` against ``client`` (a request naming none is counted nowhere)."""
        if client:
            self._client_of[request_id] = client
            self._in_flight[client] += 1

    def release(self, request_id: str) -> bool:
        """The request ended (or was refused): True when it was its client's last live one."""
        client = self._client_of.pop(request_id, None)
        if client is None:
            return False
        self._in_flight[client] -= 1
        if self._in_flight[client] > 0:
            return False
        del self._in_flight[client]
        self._idle_since[client] = time.monotonic()
        return True

    def with_work(self, live: Iterable[str], linger_s: float) -> set[str]:
        """Clients with a live request (ids ``live``: validating, waiting or placed), or whose
        last one ended within ``linger_s``."""
        clients = {self.client_of(rid) for rid in live}
        now = time.monotonic()
        for client, since in list(self._idle_since.items()):
            if client in clients or now - since >= linger_s:
                del self._idle_since[client]
            else:
                clients.add(client)
        return clients


class Placer:
    """Moves the engine's waiting requests onto its workers. It works on the engine's own
    containers (shared, not copied): the queue, the workers, where each request is placed, and
    the live requests; the engine's settings come with each call, so a changed config applies
    at once."""

    def __init__(
        self,
        waiting: collections.deque[Request],
        slots: Sequence[WorkerSlot],
        slot_of: dict[str, WorkerSlot],
        live: Mapping[str, Request | None],
    ) -> None:
        self.clients = ClientLedger()
        self._waiting = waiting
        self._slots = slots
        self._slot_of = slot_of
        self._live = live

    def place(self, config: EngineConfig) -> None:
        """Move waiting requests to the least-loaded healthy workers with room; each goes with its
        worker's next iterate() call (an idle worker's loop is woken for it)."""
        bounds = config.prompt_token_bounds
        while self._waiting:
            request = self._next_waiting(config)
            if request is None:
                break
            n = len(request.seq.prompt_token_ids)
            candidates = [
                s
                for s in self._slots
                if s.placeable
                and s.load < s.capacity
                and bounds.fits_worker(s.prompt_tokens, n)
                and kv_fits(s, request)
            ]
            if not candidates:
                # It waits at its place in the queue for room in a worker's batch (slots, prompt
                # tokens, KV memory), and the ones behind it wait too: a long request is not
                # overtaken for ever by short ones that keep fitting before it.
                break
            self._waiting.remove(request)
            slot = min(candidates, key=lambda s: s.load)
            slot.to_add.append(request)
            self._slot_of[request.request_id] = slot
            slot.wake.set()

    def _next_waiting(self, config: EngineConfig) -> Request | None:
        """The next request to place, left in the queue for ``place`` to take: the oldest waiting
        one of the client holding the fewest batch slots, among the clients it keeps within their
        share of the batch; None when no waiting client may place another now."""
        if not config.fair_placement:
            return self._waiting[0]
        healthy = [s for s in self._slots if s.placeable]
        capacity = BatchLoad(
            sum(s.capacity for s in healthy), sum(iteration_rows(s, config.max_iteration_tokens) for s in healthy)
        )
        held: dict[str, BatchLoad] = collections.defaultdict(BatchLoad)
        for rid in self._slot_of:
            placed = self._live.get(rid)
            client = self.clients.client_of(rid)
            held[client] = held[client].plus(request_rows(placed) if placed is not None else step_rows(0))
        share = client_share(capacity, len(self.clients.with_work(self._live, config.fair_share_linger_s)))
        waiting = ((r, self.clients.client_of(r.request_id), request_rows(r)) for r in self._waiting)
        return next_to_place(waiting, held, share)
