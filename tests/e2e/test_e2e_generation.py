"""Generation semantics through the full stack: greedy exactness, streaming, stop strings, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Iterator

import grpc
import pytest

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import (
    BOUNDED_SCHEMA,
    ENDLESS_MAX_TOKENS,
    ENDLESS_SCHEMA,
    LONG_MAX_TOKENS,
    LONG_SCHEMA,
    PROMPT,
    ThreadStack,
)

pytestmark = pytest.mark.slow


@pytest.fixture()
def client(stack: ThreadStack):
    with OrchestratorClient(stack.address) as c:
        yield c


@pytest.mark.parametrize(
    ("label", "grammar"),
    [
        ("schema", {"schema": BOUNDED_SCHEMA}),
        ("long-schema", {"schema": LONG_SCHEMA}),
        ("regex", {"regex": r"[a-z]{3,12}( [a-z]{2,9}){2,4}\."}),
        ("none", {}),
    ],
)
def test_greedy_speculation_equals_plain_decoding(client: OrchestratorClient, label: str, grammar: dict) -> None:
    """docs/design.md: greedy output with speculation equals plain (constrained) greedy decoding, token for token."""
    common = dict(temperature=0.0, max_tokens=LONG_MAX_TOKENS, **grammar)
    plain = client.generate(build_request(PROMPT, speculation=False, **common))
    assert plain.finish_reason != pb.FINISH_REASON_ERROR, plain.error
    assert plain.usage.drafts_proposed == 0
    assert plain.usage.target_forwards >= plain.usage.completion_tokens
    variants = [
        dict(k=4),
        dict(k=1),
        dict(k=8, draft_masking=False),
    ]
    for v in variants:
        spec = client.generate(build_request(PROMPT, speculation=True, **v, **common))
        assert list(spec.token_ids) == list(plain.token_ids), (label, v)
        assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
        assert spec.usage.drafts_proposed > 0
    if grammar.get("schema") is not None:
        assert plain.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE
        json.loads(plain.text)


def test_stream_deltas_concatenate_to_final_text(client: OrchestratorClient) -> None:
    req = build_request(PROMPT, temperature=1.0, seed=11, max_tokens=80)  # unconstrained: random bytes, partial UTF-8
    unary = client.generate(req)
    chunks = list(client.stream(req))
    assert all(c.request_id == chunks[0].request_id for c in chunks)
    assert [c.finish_reason for c in chunks[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (len(chunks) - 1)
    final = chunks[-1]
    assert final.finish_reason == unary.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert final.HasField("usage") and not any(c.HasField("usage") for c in chunks[:-1])
    # A seeded request reproduces exactly; stream deltas fold into the unary answer.
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert final.usage.completion_tokens == len(unary.token_ids)
    assert len(chunks) > 2  # it really streamed


def test_stream_text_matches_tokenizer_decode(client: OrchestratorClient, tiny_pair) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_pair[0] / "tokenizer.json"))
    for seed in range(3):
        chunks = list(client.stream(build_request(PROMPT, temperature=1.0, seed=seed, max_tokens=40)))
        ids = [t for c in chunks for t in c.token_ids]
        assert "".join(c.text for c in chunks) == tok.decode(ids, skip_special_tokens=True)


def test_stop_string(client: OrchestratorClient) -> None:
    """Without a grammar a stop string cuts the output before it; beside a grammar a match inside
    the document is ignored (docs/api-errors.md): the output is the whole document, never a cut one."""
    # Seeded sampling replays the same text (greedy text of the random-init model is one repeated
    # character, where any stop string would match at position 0).
    plain = dict(temperature=1.0, seed=5, max_tokens=32, ignore_eos=True)
    text = client.generate(build_request(PROMPT, **plain)).text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    cut = text.index(stop)
    assert cut > 0, text
    for chunks in (
        [client.generate(build_request(PROMPT, stop=[stop], **plain))],
        list(client.stream(build_request(PROMPT, stop=[stop], **plain))),
    ):
        assert "".join(c.text for c in chunks) == text[:cut]
        assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP

    base = client.generate(build_request(PROMPT, schema=LONG_SCHEMA, temperature=0.0, max_tokens=LONG_MAX_TOKENS))
    assert base.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE
    stop = '"level"'
    assert stop in base.text
    stopped = client.generate(
        build_request(PROMPT, schema=LONG_SCHEMA, temperature=0.0, max_tokens=LONG_MAX_TOKENS, stop=[stop])
    )
    assert stopped.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE
    assert stopped.text == base.text
    chunks = list(
        client.stream(
            build_request(PROMPT, schema=LONG_SCHEMA, temperature=0.0, max_tokens=LONG_MAX_TOKENS, stop=[stop])
        )
    )
    assert "".join(c.text for c in chunks) == base.text
    assert chunks[-1].finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE


def test_client_cancel_mid_stream_frees_session_and_kv(stack: ThreadStack, client: OrchestratorClient) -> None:
    stack.wait_idle()
    req = build_request(
        PROMPT, schema=ENDLESS_SCHEMA, temperature=1.0, seed=3, max_tokens=ENDLESS_MAX_TOKENS, speculation=False
    )
    call = client.stream(req)
    received = 0
    for chunk in call:
        received += len(chunk.token_ids)
        if received >= 5:
            break
    # Mid-generation: the worker holds the sequence and a replica holds its session.
    assert sum(stack.worker_num_active()) == 1
    assert stack.mask_session_count() == 1
    call.cancel()
    active, sessions = stack.wait_idle()
    assert active == [0, 0] and sessions == 0


def test_deadline_frees_session_and_kv(stack: ThreadStack, client: OrchestratorClient) -> None:
    stack.wait_idle()
    req = build_request(
        PROMPT, schema=ENDLESS_SCHEMA, temperature=1.0, seed=4, max_tokens=ENDLESS_MAX_TOKENS, speculation=False
    )
    with pytest.raises(grpc.RpcError) as exc:
        client.generate(req, timeout_s=0.5)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    active, sessions = stack.wait_idle()
    assert active == [0, 0] and sessions == 0


def test_unary_cancel_frees_everything(stack: ThreadStack, client: OrchestratorClient) -> None:
    stack.wait_idle()
    futures = [
        client.stub.Generate.future(
            build_request(
                PROMPT, schema=ENDLESS_SCHEMA, temperature=1.0, seed=s, max_tokens=ENDLESS_MAX_TOKENS, speculation=False
            ),
            timeout=120,
        )
        for s in range(6)
    ]
    deadline = time.monotonic() + 30
    while sum(stack.worker_num_active()) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(stack.worker_num_active()) == 6
    # Both workers got work: least-loaded placement spreads the batch.
    assert all(n > 0 for n in stack.worker_num_active())
    for f in futures:
        f.cancel()
    active, sessions = stack.wait_idle()
    assert active == [0, 0] and sessions == 0


def test_nothing_leaks_over_many_requests(stack: ThreadStack, client: OrchestratorClient) -> None:
    """A churn of finished, cancelled and timed-out requests leaves no request, sequence or session behind."""
    assert stack.running is not None
    rng = random.Random(5)
    calls = []
    for i in range(120):
        schema = rng.choice([BOUNDED_SCHEMA, LONG_SCHEMA, None])
        req = build_request(
            PROMPT,
            schema=schema,
            temperature=1.0,
            seed=i,
            max_tokens=rng.randint(4, 64),
            speculation=rng.random() < 0.7,
        )
        timeout = rng.choice([60.0, 60.0, 0.05, 0.3])
        stream = i % 2 == 1
        rpc = client.stub.GenerateStream if stream else client.stub.Generate.future
        call = rpc(req, timeout=timeout)
        calls.append((stream, call))
        if rng.random() < 0.3:
            call.cancel()
        time.sleep(0.005)
    for stream, call in calls:
        try:
            list(call) if stream else call.result()
        except grpc.FutureCancelledError:
            pass
        except grpc.RpcError as exc:
            assert exc.code() in (
                grpc.StatusCode.CANCELLED,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
    active, sessions = stack.wait_idle()
    assert active == [0, 0] and sessions == 0
    engine = stack.running.server.engine
    assert stack.run(_engine_counts(engine)) == (0, 0)


async def _engine_counts(engine) -> tuple[int, int]:
    return engine.num_live(), engine.queue_depth


def test_a_request_placed_on_an_idle_worker_goes_at_once(stack: ThreadStack) -> None:
    """A request placed on an idle worker wakes its loop: it is sent (running) as soon as the
    loop runs, with nothing else to wait for; and it completes. (On a worker with a call in
    flight it waits for the next: test_adds_placed_during_a_step_wait_for_the_next_call.)"""
    from specmask.gpu_worker.types import FinishReason
    from specmask.orchestrator.convert import request_from_proto

    engine = stack.running.server.engine
    msg = build_request(PROMPT, schema=BOUNDED_SCHEMA, temperature=0.0, max_tokens=64)
    stack.wait_idle()
    states, result = stack.run(_placed_state(engine, request_from_proto(msg, "placed-add")))
    assert states == (True, False)  # sent: running, not waiting in to_add
    assert result.finish_reason is FinishReason.GRAMMAR_COMPLETE and result.error is None, result
    assert set(json.loads(result.text)) == {"ok", "level", "flags"}


@contextlib.contextmanager
def _every_worker_stepping(stack: ThreadStack, *, seed: int) -> Iterator[None]:
    """Both workers busy stepping while the block runs: one endless stream each (placement
    takes the least-loaded worker), cancelled on the way out."""
    stack.wait_idle()
    busy = [
        build_request(PROMPT, schema=ENDLESS_SCHEMA, temperature=1.0, seed=seed + i, max_tokens=ENDLESS_MAX_TOKENS)
        for i in range(2)
    ]
    with OrchestratorClient(stack.address) as client:
        calls = [client.stub.GenerateStream(req, timeout=120) for req in busy]
        try:
            for call in calls:
                next(iter(call))  # generating
            yield
        finally:
            for call in calls:
                call.cancel()


def test_adds_placed_during_a_step_wait_for_the_next_call(stack: ThreadStack) -> None:
    """Requests placed while their worker's iterate() call is in flight wait in ``to_add`` and
    go with the next call (the worker could not take them sooner; one add() call per placement
    cost a flood three Ray calls per step). Such a request completes; one cancelled while it
    waits never reaches the worker (it would otherwise still be added, and run orphaned to
    its end)."""
    import ray

    from specmask.gpu_worker.types import FinishReason

    assert stack.running is not None
    engine = stack.running.server.engine
    msg = build_request(PROMPT, schema=BOUNDED_SCHEMA, temperature=0.0, max_tokens=64)
    with _every_worker_stepping(stack, seed=70):
        completed, tries_a = stack.run(_deferred(engine, msg, "deferred-kept", cancel=False), timeout_s=60)
        cancelled_id, tries_b = stack.run(_deferred(engine, msg, "deferred-cancelled", cancel=True), timeout_s=60)
        # Sampled for a second: a cancelled add() that still went out would show here for the
        # ~30 steps its sequence takes to complete.
        seen: set[str] = set()
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            for ids in ray.get([a.active_ids.remote() for a in stack.running.server.worker_actors], timeout=30):
                seen.update(ids)
            time.sleep(0.01)
    assert completed.finish_reason is FinishReason.GRAMMAR_COMPLETE and completed.error is None, completed
    assert set(json.loads(completed.text)) == {"ok", "level", "flags"}
    assert cancelled_id not in seen and not any(i.startswith("deferred-cancelled") for i in seen), seen
    assert tries_a < 50 and tries_b < 50
    active, sessions = stack.wait_idle()
    assert active == [0, 0] and sessions == 0


def test_a_request_waiting_for_a_lost_workers_step_goes_to_another_worker(stack: ThreadStack) -> None:
    """A request placed on a worker whose iterate() call is in flight is not sent yet; if that
    worker is then lost, the request is not failed with the worker's batch but placed again
    (another worker here) and completes. The loss is the engine's own handling of it
    (``_on_worker_failure``, what a dead or hung actor gets), called while the request waits;
    the worker is then probed back into placement."""
    from specmask.gpu_worker.types import FinishReason

    assert stack.running is not None
    engine = stack.running.server.engine
    msg = build_request(PROMPT, schema=BOUNDED_SCHEMA, temperature=0.0, max_tokens=64)
    with _every_worker_stepping(stack, seed=80):
        lost, moved_to, result = stack.run(_deferred_then_worker_lost(engine, msg), timeout_s=60)
    assert moved_to != lost
    assert result.finish_reason is FinishReason.GRAMMAR_COMPLETE and result.error is None, result
    deadline = time.monotonic() + 60
    while not all(engine.worker_health()):  # probed back into placement (~1 s)
        assert time.monotonic() < deadline, "the worker was not put back"
        time.sleep(0.2)
    active, sessions = stack.wait_idle()
    assert active == [0, 0] and sessions == 0


async def _deferred_then_worker_lost(engine, msg):
    request, slot, _ = await _submit_until_waiting(engine, msg, "lost-worker")
    engine._on_worker_failure(slot, RuntimeError("injected: worker lost"))
    moved = engine._requests.slot_of[request.request_id]
    return slot.index, moved.index, await request.result()


async def _deferred(engine, msg, prefix: str, *, cancel: bool):
    """One copy of ``msg`` that waits in ``to_add`` for its worker's next call; cancel or await it."""
    request, slot, attempt = await _submit_until_waiting(engine, msg, prefix)
    assert request.request_id not in slot.running
    if cancel:
        engine.cancel(request.request_id)
        return request.request_id, attempt
    return await request.result(), attempt


async def _submit_until_waiting(engine, msg, prefix: str):
    """Submit copies of ``msg`` (its workers busy stepping) until one waits in ``to_add`` for
    the next call; return it, its slot and the attempt. Copies sent at once are cancelled and
    waited out."""
    from specmask.orchestrator.convert import request_from_proto

    for attempt in range(50):
        request = await engine.submit(request_from_proto(msg, f"{prefix}-{attempt}"))
        slot = engine._requests.slot_of[request.request_id]
        if request in slot.to_add:
            return request, slot, attempt
        engine.cancel(request.request_id)
        await request.result()
    raise AssertionError("no request waited for its worker's next call in 50 tries")


async def _placed_state(engine, req):
    request = await engine.submit(req)
    slot = engine._requests.slot_of[request.request_id]
    await asyncio.sleep(0)  # the woken loop runs: the request goes with its iterate() call
    states = (request.request_id in slot.running, request in slot.to_add)
    return states, await request.result()


class _IterateRefusedOnce:
    """A worker's Ray actor handle whose next ``iterate.remote()`` raises, as Ray's does when it
    cannot take a call (a broken handle, Ray shutting down); everything else is the real actor.
    ``budget`` (shared by the handles of several workers) is how many refusals there are in all."""

    def __init__(self, actor, budget: list[int]) -> None:
        self._actor = actor
        self._budget = budget
        self.refused = 0

    def __getattr__(self, name: str):
        method = getattr(self._actor, name)
        if name != "iterate" or self.refused or self._budget[0] <= 0:
            return method
        handle = self

        class _Refusing:
            def remote(self, *args, **kwargs):
                handle.refused += 1
                handle._budget[0] -= 1
                raise RuntimeError("injected: Ray could not submit the call")

        return _Refusing()


def test_a_request_whose_iterate_call_ray_refuses_is_requeued_and_completes(stack: ThreadStack) -> None:
    """If Ray refuses the iterate() call that carries a request's add, that worker is taken out
    and recovered, and the request, which has emitted nothing, goes back to the queue and completes
    on the other worker (before, it was failed; earlier still, its client waited out its
    deadline). One call in all is refused, on whichever worker the request lands first."""
    from specmask.gpu_worker.types import FinishReason
    from specmask.orchestrator.convert import request_from_proto

    engine = stack.running.server.engine
    stack.wait_idle()
    slots = engine._slots
    real = [slot.actor for slot in slots]
    budget = [1]
    wrapped = [_IterateRefusedOnce(actor, budget) for actor in real]
    for slot, proxy in zip(slots, wrapped, strict=True):
        slot.actor = proxy
    requeued_before = _requeued(stack)
    try:
        msg = build_request(PROMPT, schema=BOUNDED_SCHEMA, temperature=0.0, max_tokens=64)
        result = stack.run(_submit_and_wait(engine, request_from_proto(msg, "add-refused")), timeout_s=120)
    finally:
        for slot, actor in zip(slots, real, strict=True):
            slot.actor = actor
    assert sum(p.refused for p in wrapped) == 1
    assert result.finish_reason is FinishReason.GRAMMAR_COMPLETE, result
    assert _requeued(stack) >= requeued_before + 1
    deadline = time.monotonic() + 60
    while not all(slot.healthy for slot in slots):  # probed back into placement (~1 s)
        assert time.monotonic() < deadline, "the worker was not put back"
        time.sleep(0.2)
    with OrchestratorClient(stack.address) as client:
        after = client.generate(build_request(PROMPT, schema=BOUNDED_SCHEMA, temperature=0.0, max_tokens=64))
    assert after.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE, after.error
    active, sessions = stack.wait_idle()
    assert active == [0, 0] and sessions == 0


def _requeued(stack: ThreadStack) -> float:
    """The orchestrator's count of requests put back in the queue after losing their worker."""
    value = stack.running.server.metrics.registry.get_sample_value("specmask_requeued_requests_total")
    return value or 0.0


async def _submit_and_wait(engine, req):
    request = await engine.submit(req)
    return await request.result()
