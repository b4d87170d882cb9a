"""What one step's output means for its request: still running, finished, or finished once its
text passes the end check (docs/design.md, "Who runs what").

The engine's step loop folds each output into its request (detokenizing, stop strings and stop
tokens: ``Request.apply_step``), then asks ``step_outcome`` what follows. A stop match in a
grammar request ends the output before anything the worker reports for that step, and counts
only once the end check accepts the text up to it; a grammar request the worker calls complete
is checked the same way. A stop match in the step that reached max_tokens reports STOP, as vLLM
does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from specmask.gpu_worker.types import FinishReason


class Settle(enum.Enum):
    RUNNING = "running"  # it goes on generating
    CHECK = "check"  # it ends with ``reason`` once the end check accepts its text (checked_retry)
    FINISH = "finish"  # it ends with ``reason`` now


@dataclass(frozen=True)
class StepOutcome:
    settle: Settle
    reason: FinishReason | None = None  # CHECK and FINISH: the reason it ends with
    remove: bool = False  # it ended here while the worker still holds it: free it with remove()


RUNNING = StepOutcome(Settle.RUNNING)


def step_outcome(worker_reason: FinishReason | None, *, hit_stop: bool, has_grammar: bool) -> StepOutcome:
    """The outcome of a step whose output the worker finished with ``worker_reason`` (None: still
    running there), where the request's stop strings or stop tokens matched (``hit_stop``)."""
    if hit_stop and has_grammar:
        # Before the worker's own finish: the stop match ended the output first.
        return StepOutcome(Settle.CHECK, FinishReason.STOP, remove=worker_reason is None)
    if worker_reason is not None:  # the worker freed the sequence
        if worker_reason is FinishReason.GRAMMAR_COMPLETE and has_grammar:
            return StepOutcome(Settle.CHECK, FinishReason.GRAMMAR_COMPLETE)
        if hit_stop and worker_reason is FinishReason.LENGTH:
            # A stop string or stop token in the step that reached max_tokens ended the
            # output first (its text is cut there): "stop", as vLLM reports it.
            return StepOutcome(Settle.FINISH, FinishReason.STOP)
        return StepOutcome(Settle.FINISH, worker_reason)
    if hit_stop:
        return StepOutcome(Settle.FINISH, FinishReason.STOP, remove=True)
    return RUNNING
