"""The worker as a real Ray actor (local cluster, CPU fallback), every get with a timeout."""

from __future__ import annotations

import os

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, SpeculationParams
from specmask.orchestrator.worker_pool import init_local_ray

ray = pytest.importorskip("ray")

# Actor start imports torch + transformers in a fresh process: slow on a loaded 2-core box.
GET_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def ray_local():
    for key, value in {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # bind every port to 127.0.0.1
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
    }.items():
        os.environ.setdefault(key, value)
    init_local_ray(num_cpus=2, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_worker_serves_as_a_ray_actor(ray_local, tiny_pair, mask_address):
    from specmask.gpu_worker.actor import start_remote_worker
    from specmask.gpu_worker.config import WorkerConfig

    config = WorkerConfig(
        target_dir=str(tiny_pair[0]),
        draft_dir=str(tiny_pair[1]),
        mask_service_addresses=(mask_address,),
        torch_threads=0,  # the orchestrator's default: one thread for this tiny pair
    )
    actor = start_remote_worker(config)  # no GPU in this cluster -> num_gpus=0, CPU fallback
    try:
        info = ray.get(actor.info.remote(), timeout=GET_TIMEOUT_S)
        assert info.device == "cpu" and info.vocab_size == 300
        assert info.torch_threads == 1
        grammar = GrammarSpec(GrammarKind.REGEX, "(ab|cd){2,6}")
        seqs = [
            NewSequence("a", (5, 6, 7), grammar, SamplingParams(max_tokens=20), SpeculationParams(k=3)),
            NewSequence("a", (5,), None),  # duplicate within the call
        ]
        assert ray.get(actor.add.remote(seqs), timeout=GET_TIMEOUT_S)[0] is None
        # A bad request raises in the actor; the caller gets the message, the actor lives on.
        with pytest.raises(ray.exceptions.RayTaskError, match="unknown sequence"):
            ray.get(actor.remove.remote(["missing"]), timeout=GET_TIMEOUT_S)
        finished = {}
        for _ in range(50):
            for out in ray.get(actor.step.remote(), timeout=GET_TIMEOUT_S):
                if out.finish_reason is not None:
                    finished[out.seq_id] = out.finish_reason
            if not ray.get(actor.num_active.remote(), timeout=GET_TIMEOUT_S):
                break
        assert finished == {"a": FinishReason.GRAMMAR_COMPLETE}
        # The heartbeat answers on its own concurrency group; its count moved with the steps.
        from specmask.gpu_worker.types import LIVENESS_GROUP

        beat = ray.get(actor.progress.options(concurrency_group=LIVENESS_GROUP).remote(), timeout=GET_TIMEOUT_S)
        assert beat.count >= 2 and beat.active == 0
        # iterate(): the orchestrator's one call per iteration. Removes first (an id the worker
        # does not hold is reported, not raised), then adds (per-sequence errors), then a step
        # that already includes what was just added.
        first = ray.get(
            actor.iterate.remote(
                ["a", "gone"],
                [
                    # no stop token, a budget one step cannot use up: still running after it
                    NewSequence("b", (5, 6), None, SamplingParams(max_tokens=64), stop_token_ids=()),
                    NewSequence("b", (5,), None),
                ],
            ),
            timeout=GET_TIMEOUT_S,
        )
        assert first.unknown_removed == ["a", "gone"]  # "a" finished on the worker already
        assert first.add_errors[0] is None and "duplicate seq_id" in (first.add_errors[1] or "")
        assert [o.seq_id for o in first.outputs] == ["b"] and first.outputs[0].new_token_ids
        # A sequence removed in the same call as others are added: gone before the step.
        second = ray.get(
            actor.iterate.remote(
                ["b"], [NewSequence("c", (7,), None, SamplingParams(max_tokens=64), stop_token_ids=())]
            ),
            timeout=GET_TIMEOUT_S,
        )
        assert second.unknown_removed == [] and second.add_errors == [None]
        assert [o.seq_id for o in second.outputs] == ["c"]
        third = ray.get(actor.iterate.remote(["c"], []), timeout=GET_TIMEOUT_S)
        assert (third.unknown_removed, third.add_errors, third.outputs) == ([], [], [])  # nothing left to step
        assert ray.get(actor.num_active.remote(), timeout=GET_TIMEOUT_S) == 0
    finally:
        ray.kill(actor)
