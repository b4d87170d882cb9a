"""Where API keys come from (flags, files, environment) and how a presented key is checked."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from specmask.orchestrator.auth_keys import (
    ApiKeyError,
    ApiKeys,
    add_api_key_arguments,
    api_keys_from_args,
    load_api_keys,
)
from specmask.orchestrator.config import OrchestratorConfig


def test_keys_from_every_source_each_once(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# tenants\nsk-file-1\n\n  sk-file-2  \nsk-flag\n")
    env = {"SPECMASK_API_KEY": "sk-env", "SPECMASK_API_KEYS": "sk-envs-1, sk-envs-2\nsk-flag"}
    keys = load_api_keys(["sk-flag"], [str(key_file)], environ=env)
    assert keys == ("sk-flag", "sk-file-1", "sk-file-2", "sk-env", "sk-envs-1", "sk-envs-2")
    assert load_api_keys(environ={}) == ()  # nothing anywhere: authentication off


def test_flags_parse_and_bad_sources_are_one_line_errors(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_api_key_arguments(parser)
    empty = tmp_path / "empty"
    empty.write_text("# none yet\n")
    args = parser.parse_args(["--api-key", "a", "--api-key", "b"])
    assert api_keys_from_args(args)[:2] == ("a", "b")
    with pytest.raises(ApiKeyError, match="no keys in it"):
        load_api_keys(key_files=[str(empty)], environ={})
    with pytest.raises(ApiKeyError, match="No such file"):
        load_api_keys(key_files=[str(tmp_path / "missing")], environ={})
    with pytest.raises(ApiKeyError, match="empty key"):
        load_api_keys(["  "], environ={})


def test_presented_key_checked() -> None:
    keys = ApiKeys(("sk-a", "sk-b"))
    assert keys.allows([("Authorization", "Bearer sk-b")])
    assert keys.allows([("authorization", "bearer sk-a")])
    assert keys.allows([("x-api-key", "sk-a")])
    assert not keys.allows([("Authorization", "Bearer sk-c")])
    assert not keys.allows([("Authorization", "sk-a")])  # not a Bearer credential
    assert not keys.allows([])
    assert ApiKeys().allows([])  # no keys: open


def test_config_keeps_keys_out_of_its_repr_and_caps_clients_by_default() -> None:
    config = OrchestratorConfig(
        target_dir="t", mask_service_addresses=("127.0.0.1:1",), api_keys=("sk-secret",), max_batch=8, num_workers=2
    )
    assert "sk-secret" not in repr(config)
    assert config.inflight_cap_per_client == 2 * 8 + config.max_queue // 2
    assert (
        OrchestratorConfig(
            target_dir="t", mask_service_addresses=("h:1",), max_inflight_per_client=0
        ).inflight_cap_per_client
        == 0
    )
