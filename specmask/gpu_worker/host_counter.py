"""Counts what a step costs the host: torch operations dispatched, and reads of tensor values.

A step's host time on a GPU is mostly fixed cost per call, not per row: every torch op
dispatched costs microseconds of Python and dispatcher work whatever its size, and every
read of a device value into Python (``.tolist()``, ``.item()``, ``bool(t)``, a copy to the
CPU) waits for the device to drain its queue, so the host cannot run ahead of it. Wall
clocks on a shared CPU box cannot tell those apart from noise; counts can, and they are the
same on the CPU as on a GPU. So the host path is held to counts (tests/gpu_worker/
test_host_path.py, ``bench.gpu --dry-run``): reads per step at most one plus one per
draft-side mask round trip, and ops per step that do not grow with the batch.

``HostCounter`` installs two thread-local hooks while it is entered:

* a ``TorchFunctionMode`` sees every Python-level torch call, and counts the ones that
  read values into Python (``READS``) on a tensor of the counted device, plus copies to
  the CPU from any other device (``.cpu()``, ``.to("cpu")``, ``copy_`` into a CPU tensor);
* a ``TorchDispatchMode`` counts every aten op the dispatcher runs (what a CUDA graph
  replay does not go through), and any device-to-host copy not reached through the
  Python calls above (a kernel wrapper's own ``.cpu()`` in C++).

``paused()`` stops counting for a region: the bench and tests pause inside model forwards,
which a GPU replays as CUDA graphs (gpu_worker.static_forward), so the counts are those of
the step's own host path. On a CPU device every read counts: "device to host" there means
the points where the step turns tensor values into Python values.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["READS", "HostCounter", "StepCount", "StepCounter"]

# Tensor methods that hand tensor values to Python: each waits for the device.
READS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.numpy,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.equal,
    }
)
# Calls that copy to the CPU: a read when the source is on another device.
_TO_HOST: frozenset[Callable[..., Any]] = frozenset({torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.copy_})
# aten ops that copy between devices (a device-to-host copy has a CPU output and a non-CPU input).
_COPY_OPS = frozenset({"aten::_to_copy", "aten::copy_"})


def _caller() -> str:
    """``module:line`` of the innermost frame outside torch and this module: where a read happened."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and (
        frame.f_globals.get("__name__", "").startswith("torch") or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_lineno}"


def _first_tensor(args: tuple[Any, ...]) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def _copies_to_host(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``_TO_HOST`` call moves data from a non-CPU device onto the CPU."""
    if func is torch.Tensor.copy_:
        dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
        return isinstance(src, torch.Tensor) and dst.device.type == "cpu" and src.device.type != "cpu"
    src = args[0]
    if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
        return False
    if func is torch.Tensor.cpu:
        return True
    # Tensor.to(device | dtype | tensor, ...): host-bound when a device or tensor argument says CPU.
    for target in (*args[1:], kwargs.get("device")):
        if isinstance(target, torch.Tensor):
            return target.device.type == "cpu"
        if isinstance(target, (str, torch.device)):
            return torch.device(target).type == "cpu"
    return False


class _Functions(TorchFunctionMode):
    def __init__(self, counter: HostCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        c = self.counter
        read = False
        if c.active:
            if func in READS:
                t = _first_tensor(args)
                read = t is not None and t.device.type == c.device.type
            elif func in _TO_HOST:
                read = _copies_to_host(func, args, kwargs)
            if read:
                c.reads += 1
                c.read_sites[f"{getattr(func, '__name__', func)} @ {_caller()}"] += 1
        c.inside_read += read
        try:
            return func(*args, **kwargs)
        finally:
            c.inside_read -= read


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: HostCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counter
        if c.active:
            c.ops += 1
            name = func._schema.name
            c.op_names[name] += 1
            if name in _COPY_OPS and not c.inside_read:
                src = args[1] if name == "aten::copy_" else args[0]
                dst = args[0] if name == "aten::copy_" else out
                if (
                    isinstance(src, torch.Tensor)
                    and isinstance(dst, torch.Tensor)
                    and src.device.type != "cpu"
                    and dst.device.type == "cpu"
                ):
                    c.reads += 1
                    c.read_sites[name] += 1
        return out


class HostCounter:
    """Counts torch ops and host reads on the current thread while entered (see module doc)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.ops = 0
        self.reads = 0
        self.op_names: collections.Counter[str] = collections.Counter()
        self.read_sites: collections.Counter[str] = collections.Counter()
        self.active = False
        self.inside_read = 0
        self._modes: tuple[_Functions, _Dispatch] | None = None

    def reset(self) -> None:
        self.ops = self.reads = 0
        self.op_names.clear()
        self.read_sites.clear()

    def __enter__(self) -> HostCounter:
        functions, dispatch = _Functions(self), _Dispatch(self)
        functions.__enter__()
        dispatch.__enter__()
        self._modes = (functions, dispatch)
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._modes is not None
        functions, dispatch = self._modes
        self.active = False
        dispatch.__exit__(None, None, None)
        functions.__exit__(None, None, None)
        self._modes = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Count nothing inside (a model forward: graph replays on a GPU)."""
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was

    def pause_calls(self, obj: Any, name: str) -> Callable[[], None]:
        """Wrap ``obj.name`` so that its calls run ``paused``; returns the undo."""
        inner = getattr(obj, name)
        own = name in vars(obj)  # an instance attribute (already wrapped), not the class's method

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.paused():
                return inner(*args, **kwargs)

        setattr(obj, name, wrapped)

        def undo() -> None:
            if own:
                setattr(obj, name, inner)
            else:
                delattr(obj, name)

        return undo


class StepCounter:
    """Per-step counts of a worker's steps (``GpuWorker``: ``target``, ``draft``, ``stepper``).

    Model forwards run paused (graph replays on a GPU). ``round_trips``: the mask requests the
    step sent that carry its drafts (draft-side and verify-path requests: each needs the tokens
    on the host), not the next step's position-1 prefetch, which carries the commit that the
    step's one read of the accepted tokens already brought back."""

    def __init__(self, worker: Any, device: torch.device | str) -> None:
        self.counter = HostCounter(device)
        self.round_trips = 0
        self._in_prefetch = False
        self._undo: list[Callable[[], None]] = []
        self._worker = worker

    def __enter__(self) -> StepCounter:
        w = self._worker
        for runner in (w.target, getattr(w, "draft", None)):
            if runner is not None:
                self._undo.append(self.counter.pause_calls(runner, "forward"))
        drafter = w.stepper.drafter
        if drafter.masks is not None:
            masks, request = drafter.masks, drafter.masks.request
            own = "request" in vars(masks)

            def counted(*args: Any, **kwargs: Any) -> Any:
                if self.counter.active and not self._in_prefetch:
                    self.round_trips += 1
                return request(*args, **kwargs)

            masks.request = counted
            self._undo.append(lambda: setattr(masks, "request", request) if own else delattr(masks, "request"))
        prefetch = drafter.prefetch_first

        def prefetching(*args: Any, **kwargs: Any) -> Any:
            self._in_prefetch = True
            try:
                return prefetch(*args, **kwargs)
            finally:
                self._in_prefetch = False

        drafter.prefetch_first = prefetching
        self._undo.append(lambda: delattr(drafter, "prefetch_first"))
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def step(self) -> tuple[Any, StepCount]:
        """Run one ``worker.step()`` counted; returns its outputs and counts."""
        self.counter.reset()
        self.round_trips = 0
        with self.counter:
            outs = self._worker.step()
        c = self.counter
        return outs, StepCount(c.reads, c.ops, self.round_trips, dict(c.read_sites), dict(c.op_names))


@dataclass(frozen=True)
class StepCount:
    reads: int  # host reads of tensor values (device-to-host syncs on a GPU)
    ops: int  # torch ops dispatched outside model forwards
    round_trips: int  # mask requests carrying the step's drafts (StepCounter)
    read_sites: dict[str, int]  # which calls read
    op_names: dict[str, int]  # aten op -> count
