"""`specmask serve MODEL` as a real process tree, driven with vLLM's flag names and the `openai`
client: the served model name and context cap show in /v1/models, a chat answers, /metrics is on
the HTTP port, its mask service refuses a caller without this start's token, and Ctrl-C stops
everything. Its --speculative-config parsing is checked without a process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from specmask.orchestrator.dev.serve import Speculative, parse_speculative_config
from tests.e2e_cli.test_e2e_cli import STOP_TIMEOUT_S, _cli, _descendants, assert_mask_service_locked, wait_until_up
from tests.fixtures.openai_sdk import openai_sdk
from tests.fixtures.procs import exited

pytestmark = pytest.mark.slow


def test_speculative_config_maps_vllm_keys() -> None:
    assert parse_speculative_config(None) == Speculative(None, None)
    assert parse_speculative_config('{"model": "d", "num_speculative_tokens": 3}') == Speculative("d", 3)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}') == Speculative("none", 2)
    for bad, needle in (
        ("[1]", "JSON object"),
        ("{", "not JSON"),
        ('{"draft_tensor_parallel_size": 1}', "unsupported keys"),
        ('{"method": "eagle"}', "method"),
        ('{"num_speculative_tokens": -1}', "num_speculative_tokens"),
        ('{"method": "ngram", "model": "d"}', "no model"),
    ):
        with pytest.raises(ValueError, match=needle):
            parse_speculative_config(bad)


def test_serve_with_vllm_flags(tiny_pair, tmp_path: Path) -> None:
    target, draft = tiny_pair
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    serve = subprocess.Popen(
        _cli(
            "serve",
            str(target),
            "--host",
            "127.0.0.1",
            "--port",
            "0",  # free ports, printed once bound (a shared machine may hold 8000 / 50051)
            "--grpc-port",
            "0",
            "--served-model-name",
            "tiny-chat",
            "--max-model-len",
            "256",
            "--speculative-config",
            json.dumps({"model": str(draft), "num_speculative_tokens": 2}),
            "--grammar-fallback",
            "refuse",  # a schema no engine enforces exactly: refused unless the request opts in
            "--log-level",
            "WARNING",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    lines: list[str] = []
    try:
        match = re.search(r"OpenAI API (http://127\.0\.0\.1:\d+)/v1", wait_until_up(serve, "serve", lines))
        assert match, lines[-1]
        root = match.group(1)
        with openai_sdk(root + "/v1", timeout_s=120) as client:
            (card,) = client.models.list().data
            assert card.id == "tiny-chat" and card.model_extra["max_model_len"] == 256
            resp = client.chat.completions.create(
                model="tiny-chat",
                messages=[{"role": "user", "content": "hi"}],
                response_format={"type": "json_object"},
                max_tokens=32,
                seed=1,
            )
            assert resp.choices[0].finish_reason in ("stop", "length")
            assert resp.usage.model_extra["specmask"]["drafts_proposed"] > 0  # the draft of --speculative-config
            unique = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
            fmt = {"type": "json_schema", "json_schema": {"name": "pair", "schema": unique}}
            with pytest.raises(openai.BadRequestError) as refused:  # --grammar-fallback refuse
                client.completions.create(
                    model="tiny-chat", prompt="x", max_tokens=16, extra_body={"guided_json": unique}
                )
            assert "uniqueItems" in refused.value.message and "checked mode" in refused.value.message
            opted = client.chat.completions.create(  # the request opts in: served under the relaxation
                model="tiny-chat",
                messages=[{"role": "user", "content": "hi"}],
                response_format=fmt,
                max_tokens=16,
                temperature=1.0,
                seed=1,
                extra_body={"guided_checked": True, "guided_max_attempts": 8},
            )
            assert opted.usage.model_extra["specmask"]["grammar"]["enforcement"] == "checked"
            pair = json.loads(opted.choices[0].message.content)
            assert sorted(pair) == [1, 2]
        metrics = httpx.get(root + "/metrics").text
        assert "vllm:e2e_request_latency_seconds_count" in metrics
        assert_mask_service_locked(lines[-1])
        children = _descendants(serve.pid)
        serve.send_signal(signal.SIGINT)
        rest, _ = serve.communicate(timeout=STOP_TIMEOUT_S)
        lines.append(rest)
        assert serve.returncode == 0, "".join(lines)
        deadline = time.monotonic() + 30
        while (alive := [p for p, c in children.items() if not exited(p, c)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive, {p: children[p] for p in alive}
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(30)
