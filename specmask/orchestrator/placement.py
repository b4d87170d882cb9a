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
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

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
