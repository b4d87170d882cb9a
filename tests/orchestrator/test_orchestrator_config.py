"""OrchestratorConfig refuses bad values with the reason (main.py turns that into exit code 2)."""

from __future__ import annotations

import pytest

from specmask.orchestrator.config import OrchestratorConfig


def test_mask_service_targets_are_checked() -> None:
    for ok in (("mask:50061",), ("dns:///mask-headless.ns.svc.cluster.local:50061", "10.0.0.5:50061")):
        OrchestratorConfig(target_dir="/m", mask_service_addresses=ok)
    for bad in ((), ("mask",), ("mask:0",), ("dns://1.1.1.1/mask:50061",), ("dns:///mask",)):
        with pytest.raises(ValueError):
            OrchestratorConfig(target_dir="/m", mask_service_addresses=bad)


def test_worker_max_restarts() -> None:
    assert OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",)).worker_max_restarts == -1
    OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",), worker_max_restarts=0)
    with pytest.raises(ValueError, match="worker_max_restarts"):
        OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",), worker_max_restarts=-2)


def test_workers_log_at_info_with_the_orchestrator_format() -> None:
    """A Ray actor starts with WARNING and no handler: without this its [request_id=...] lines are lost."""
    cfg = OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",), log_format="json")
    assert (cfg.worker_config().log_level, cfg.worker_config().log_format) == ("INFO", "json")


def test_worker_torch_threads() -> None:
    """0 (default) = every CPU of the worker process; Ray alone would give a CPU actor one thread."""
    cfg = OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",))
    assert cfg.worker_config().torch_threads == 0
    assert (
        OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",), worker_torch_threads=3)
        .worker_config()
        .torch_threads
        == 3
    )
    with pytest.raises(ValueError, match="worker_torch_threads"):
        OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",), worker_torch_threads=-1)


def test_step_prefill_tokens_reach_the_workers() -> None:
    cfg = OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",))
    assert cfg.worker_config().step_prefill_tokens == 512
    cfg = OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",), step_prefill_tokens=1)
    assert cfg.worker_config().step_prefill_tokens == 1
    with pytest.raises(ValueError, match="step_prefill_tokens"):
        OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",), step_prefill_tokens=0)


def test_vllm_flag_names_and_the_kv_budget_reach_the_workers() -> None:
    import argparse

    from specmask.orchestrator.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--target", "/m", "--mask-service", "127.0.0.1:1"]
    args = parser.parse_args([*base, "--max-num-seqs", "12", "--max-num-batched-tokens", "96", "--kv-cache-bytes", "5"])
    worker = config_from_args(args).worker_config()
    assert (worker.max_batch, worker.max_iteration_tokens, worker.kv_cache_bytes) == (12, 96, 5)
    assert worker.gpu_memory_utilization is None
    args = parser.parse_args([*base, "--gpu-memory-utilization", "0.9"])
    assert config_from_args(args).worker_config().gpu_memory_utilization == 0.9
    for bad in (
        ["--gpu-memory-utilization", "1.5"],
        ["--kv-cache-bytes", "0"],
        ["--kv-cache-bytes", "9", "--gpu-memory-utilization", "0.5"],
    ):
        with pytest.raises(ValueError):
            config_from_args(parser.parse_args([*base, *bad]))


def test_grammar_fallback_flag() -> None:
    """--grammar-fallback: checked by default (safe: an invalid output is never returned), refuse on request."""
    import argparse

    from specmask.orchestrator.main import add_arguments, config_from_args
    from specmask.orchestrator.validation import GrammarFallback

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--target", "/m", "--mask-service", "127.0.0.1:1"]
    assert config_from_args(parser.parse_args(base)).grammar_fallback is GrammarFallback.CHECKED
    refuse = config_from_args(parser.parse_args([*base, "--grammar-fallback", "refuse"]))
    assert refuse.grammar_fallback is GrammarFallback.REFUSE
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parser.parse_args([*base, "--grammar-fallback", "lenient"])
    with pytest.raises(ValueError, match="GrammarFallback"):  # a bare string is not the enum
        OrchestratorConfig(target_dir="/m", mask_service_addresses=("m:1",), grammar_fallback="refuse")  # type: ignore[arg-type]
