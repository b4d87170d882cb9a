"""How a worker's failure is told to a client (orchestrator.worker_calls.describe): the worker's
own exception in one line, never Ray's traceback or wrapper text."""

from __future__ import annotations

from ray.exceptions import RayTaskError

from specmask.gpu_worker.types import UnknownSequenceError
from specmask.orchestrator.worker_calls import describe


def test_a_worker_exception_is_its_own_first_line() -> None:
    exc = RayTaskError("iterate", "Traceback (most recent call last):\n  ...\nValueError: bad", ValueError("bad\nmore"))
    assert describe(exc) == "ValueError: bad"


def test_a_local_exception_and_an_empty_message() -> None:
    assert describe(TimeoutError()) == "TimeoutError: "
    assert describe(RuntimeError("Ray could not submit the call")) == "RuntimeError: Ray could not submit the call"


def test_unknown_sequences_read_as_their_message() -> None:
    exc = RayTaskError("remove", "tb", UnknownSequenceError("not held: r-1, r-2"))
    assert describe(exc) == "UnknownSequenceError: not held: r-1, r-2"


def test_odd_text_stays_one_line() -> None:
    cause = ValueError("ünïcödé \u2028 line\r\nnext")
    got = describe(RayTaskError("step", "tb", cause))
    assert got.startswith("ValueError: ünïcödé") and "\n" not in got and "next" not in got
