"""Fixtures: one real stack (see stack.py) shared by all end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from specmask.orchestrator.dev.local_stack import StackConfig
from tests.e2e.stack import MAX_BATCH, MAX_QUEUE, ThreadStack
from tests.fixtures.openai_sdk import openai_sdk, served_model


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    return build_tiny_model_pair(tmp_path_factory.mktemp("e2e-tiny"))


# Package scope (tests/e2e has an __init__.py for this): the stack, and the Ray
# it started in this process, are gone before other test packages run, so
# their own ray.init() finds no cluster already running.
@pytest.fixture(scope="package")
def stack(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadStack]:
    target, draft = tiny_pair
    config = StackConfig(
        target_dir=str(target),
        draft_dir=str(draft),
        mask_replicas=2,
        num_workers=2,
        metrics_port=0,
        log_dir=str(tmp_path_factory.mktemp("e2e-logs")),
    )
    # http_port=0: the OpenAI-compatible API on a free port too (test_e2e_http.py).
    # Workers log at INFO (their per-request lines carry the request id: test_e2e_request_id).
    s = ThreadStack(
        config, max_batch=MAX_BATCH, max_queue=MAX_QUEUE, default_max_tokens=64, http_port=0, worker_log_level="INFO"
    ).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def openai_client(stack: ThreadStack) -> Iterator[openai.OpenAI]:
    """The OpenAI SDK on the shared stack's HTTP API."""
    with openai_sdk(stack.http_url + "/v1") as client:
        yield client


@pytest.fixture(scope="module")
def model(openai_client: openai.OpenAI) -> str:
    """The id of the one model the shared stack serves."""
    return served_model(openai_client)
