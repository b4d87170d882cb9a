"""The engine's settings (``Engine``, its placement and its worker supervision), in one frozen value.

Kept apart from engine.py so placement.py and supervision.py read the same settings without
importing the engine (docs/design.md, "Who runs what").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specmask.orchestrator.token_admission import PromptTokenBounds


@dataclass(frozen=True)
class EngineConfig:
    max_queue: int  # requests validating or waiting beyond which submit() refuses
    # The liveness limit: an iterate() call running past it is not a failure while the worker's
    # heartbeat (GpuWorker.progress) answers within it and its progress count moves; the bound
    # of every other Ray call to a worker.
    step_timeout_s: float
    validation_threads: int
    # Requests one end client (GenerationRequest.client) may have in flight; 0 = no cap. Bounds
    # one client's share of the batches, so its flood is its own queueing.
    max_inflight_per_client: int = 0
    # Place the oldest request of the client holding the fewest batch slots, and none past a
    # client's share of the batch while others have work (orchestrator.placement);
    # False: strict arrival order (bench.fairness's control).
    fair_placement: bool = True
    # A client counts as having work for this long after its last request ended, so one sending
    # requests back to back keeps its share between them (orchestrator.placement). 0 = not at all.
    fair_share_linger_s: float = 2.0
    # The workers' iteration budget (WorkerConfig.max_iteration_tokens; 0 = by device): the rows
    # of a step that fair placement shares between clients.
    max_iteration_tokens: int = 0
    # Queue and per-worker batch bounded in prompt tokens (orchestrator.token_admission).
    prompt_token_bounds: PromptTokenBounds = field(default_factory=PromptTokenBounds)
    # With no healthy worker left while a lost one is being recovered or replaced: how long the
    # queued requests, and new ones, wait for it (from the loss of the last one) before they
    # fail (queued: ERROR) or are refused (new: UNAVAILABLE, a retry hint). 0 = fail at once.
    recovery_wait_s: float = 120.0
    # Replacement actors the engine may start per worker over its life (-1 = no limit, 0 = none:
    # a lost worker comes back only if it answers again).
    max_restarts: int = -1
