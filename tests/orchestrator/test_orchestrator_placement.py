"""Fair placement (orchestrator.placement): round-robin between clients, and no client past its
share of the batch's slots and per-iteration rows while others have work.

The batch is simulated step by step with the real placement functions (the engine's
``_next_waiting`` is their only caller, with the loads it counts from its placed requests)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import pytest

from specmask.orchestrator.placement import (
    UNCAPPED_ROWS,
    BatchLoad,
    client_share,
    next_to_place,
    step_rows,
    within_share,
)


def test_shares() -> None:
    # Alone: every slot but the reserve (an eighth, none below 8 slots); rows uncapped (past the
    # budget the worker trims drafts: a lone client's batch is not cut to the budget).
    assert client_share(BatchLoad(8, 48), 1) == BatchLoad(7, UNCAPPED_ROWS)
    assert client_share(BatchLoad(4, 48), 1) == BatchLoad(4, UNCAPPED_ROWS)
    assert client_share(BatchLoad(256, 512), 0) == BatchLoad(224, UNCAPPED_ROWS)
    assert within_share(BatchLoad(200, 1000), 5, client_share(BatchLoad(256, 512), 1))
    # Several: 1/n of each, rounded up, so the shares cover the batch.
    assert client_share(BatchLoad(8, 48), 2) == BatchLoad(4, 24)
    assert client_share(BatchLoad(8, 48), 3) == BatchLoad(3, 16)
    assert client_share(BatchLoad(8, 48), 20) == BatchLoad(1, 3)
    assert step_rows(4) == 5 and step_rows(0) == 1 and step_rows(-1) == 1


def test_within_share() -> None:
    share = BatchLoad(4, 24)
    assert within_share(BatchLoad(3, 15), 5, share)  # 4 slots, 20 rows
    assert not within_share(BatchLoad(4, 20), 1, share)  # a fifth slot
    assert not within_share(BatchLoad(2, 18), 9, share)  # 27 rows
    # A client holding nothing may always place one request, however wide.
    assert within_share(BatchLoad(), 100, share)
    assert not within_share(BatchLoad(), 1, BatchLoad(0, 0))  # no healthy slot at all


def test_next_to_place_prefers_the_client_holding_least_and_skips_those_at_share() -> None:
    held = {"flood": BatchLoad(4, 20), "b": BatchLoad(1, 5)}
    waiting = [("f1", "flood", 5), ("f2", "flood", 5), ("b1", "b", 5), ("c1", "c", 5)]
    share = BatchLoad(4, 24)
    assert next_to_place(waiting, held, share) == "c1"  # holds nothing
    assert next_to_place(waiting[:3], held, share) == "b1"  # the flood is at its share
    assert next_to_place(waiting[:2], held, share) is None
    # FIFO within a client: its oldest request first, even when a later one would fit.
    held = {"a": BatchLoad(3, 15)}
    assert next_to_place([("wide", "a", 17), ("narrow", "a", 1)], held, share) is None


@dataclass
class Batch:
    """One worker's batch: a queue, the requests placed (client, rows, steps left)."""

    slots: int
    rows: int
    queue: collections.deque[tuple[str, str, int, int]] = field(default_factory=collections.deque)
    placed: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    idle_clients: set[str] = field(default_factory=set)  # counted as having work (the linger)

    def held(self) -> dict[str, BatchLoad]:
        out: dict[str, BatchLoad] = collections.defaultdict(BatchLoad)
        for client, rows, _ in self.placed.values():
            out[client] = out[client].plus(rows)
        return out

    def place(self) -> None:
        while len(self.placed) < self.slots and self.queue:
            clients = {c for _, c, _, _ in self.queue} | {c for c, _, _ in self.placed.values()} | self.idle_clients
            share = client_share(BatchLoad(self.slots, self.rows), len(clients))
            pick = next_to_place(((r, c, w) for r, c, w, _ in self.queue), self.held(), share)
            if pick is None:
                return
            (entry,) = [e for e in self.queue if e[0] == pick]
            self.queue.remove(entry)
            self.placed[pick] = (entry[1], entry[2], entry[3])

    def step(self) -> list[str]:
        """One step: every placed request advances; returns those that finished."""
        done = []
        for rid, (client, rows, left) in list(self.placed.items()):
            if left <= 1:
                done.append(rid)
                del self.placed[rid]
            else:
                self.placed[rid] = (client, rows, left - 1)
        self.place()
        return done

    def count(self, client: str) -> int:
        return sum(c == client for c, _, _ in self.placed.values())


def test_a_flood_shrinks_to_its_share_while_a_trickle_has_work_and_regrows_after() -> None:
    """The case bench.fairness measures: a flood of long requests fills the batch while alone;
    a light client sends short requests one after another. Once the light client has work, the
    flood is not placed past half the batch (its running requests finish first), and the light
    client's requests are placed at once (the reserve, then its share)."""
    batch = Batch(slots=8, rows=48)
    batch.queue.extend((f"f{i}", "flood", 5, 20 + 3 * i) for i in range(40))
    batch.place()
    assert batch.count("flood") == 7  # alone: all but the reserve
    batch.idle_clients.add("light")  # from now on the light client has work (or lingers)
    sizes, waits = [], []
    for n in range(6):
        batch.queue.append((f"l{n}", "light", 5, 8))
        batch.place()
        waited = 0
        while f"l{n}" not in batch.placed:
            batch.step()
            waited += 1
        waits.append(waited)
        while f"l{n}" in batch.placed:
            sizes.append(len(batch.placed))
            batch.step()
        assert batch.count("flood") <= 7
    assert waits == [0] * 6
    # The flood's long requests end and are not replaced past its share: by the later light
    # requests the batch they run in is at most the flood's 4 plus their own 1.
    assert max(sizes[-8:]) <= 5
    assert batch.count("flood") == 4
    # The light client is gone for good (its linger ended): the flood takes all but the reserve again.
    batch.idle_clients.clear()
    batch.step()
    assert batch.count("flood") == 7


def test_per_iteration_rows_bind_a_wide_speculating_client() -> None:
    """A client speculating 8 drafts (9 rows a step) holds at most its share of the iteration's
    rows (24 of 48 with two clients): two sequences, though half the slots would be four."""
    batch = Batch(slots=8, rows=48)
    batch.queue.extend((f"w{i}", "wide", step_rows(8), 100) for i in range(10))
    batch.queue.extend((f"n{i}", "narrow", step_rows(2), 100) for i in range(10))
    batch.place()
    assert batch.count("wide") == 2 and batch.count("narrow") == 4
    assert sum(rows for c, rows, _ in batch.placed.values() if c == "wide") <= 24


@pytest.mark.parametrize("clients", [2, 3, 5])
def test_no_client_is_placed_past_its_share_while_others_wait(clients: int) -> None:
    batch = Batch(slots=8, rows=48)
    for i in range(12):
        for c in range(clients):
            batch.queue.append((f"c{c}-{i}", f"c{c}", 5, 3 + (i + c) % 5))
    batch.place()
    while batch.queue:
        share = client_share(
            BatchLoad(8, 48), len({c for _, c, _, _ in batch.queue} | {c for c, _, _ in batch.placed.values()})
        )
        for client, load in batch.held().items():
            if any(c == client for _, c, _, _ in batch.queue):
                assert load.slots <= share.slots and load.rows <= share.rows, (client, load, share)
        batch.step()
