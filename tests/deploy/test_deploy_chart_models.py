"""The chart as a user meets it: NOTES.txt (the OpenAI base URL and a curl line), the
optional model download into the model volume, and the optional draft.

The download initContainer's and the wait initContainer's shell scripts are run here, as
rendered, under /bin/sh: the Hub is out of reach, so ``hf`` on their PATH is a small script
that writes what a download writes (a file under --local-dir) or fails, and logs its
arguments. What is checked is the chart's part: what gets downloaded where, that a finished
download is not repeated, that one cut short is, and that the mask service waits for it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.test_deploy_chart import (
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    _chart,
    container,
    flags,
    one,
    render,
    rendered,
)

helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed (pip install '.[dev]')")

SH = "/bin/sh"


def _notes(values: dict[str, Any]) -> str:
    return _chart().render(values, name=RELEASE, namespace=NAMESPACE)["specmask/templates/NOTES.txt"]


def test_notes_print_the_openai_base_url_and_a_curl_line() -> None:
    notes = _notes({})
    assert "OpenAI base URL: http://127.0.0.1:8000/v1" in notes
    assert f"port-forward svc/{RELEASE}-specmask-orchestrator 8000:8000" in notes
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in notes
    assert '"model": "target"' in notes and "Authorization" not in notes
    assert f"http://{RELEASE}-specmask-orchestrator.{NAMESPACE}.svc.cluster.local:8000/v1" in notes
    ingress = _notes(
        {
            "models": {"target": "org/Qwen3-8B"},
            "orchestrator": {
                "apiKeys": {"enabled": True, "keys": ["k"]},
                "http": {"ingress": {"enabled": True, "host": "llm.example.com", "tls": {"enabled": True}}},
            },
        }
    )
    assert "OpenAI base URL: https://llm.example.com/v1" in ingress
    assert '-H "Authorization: Bearer $SPECMASK_API_KEY"' in ingress
    assert '"model": "Qwen3-8B"' in ingress  # the served id is the target dir's name
    off = _notes({"orchestrator": {"http": {"enabled": False}}})
    assert "OpenAI base URL" not in off and "orchestrator.http.enabled=false" in off


def test_no_draft_means_no_draft_flag() -> None:
    docs = rendered("download-no-draft")
    args = container(one(docs, "Deployment", "-orchestrator"))["args"]
    assert not [a for a in args if a.startswith("--draft")]
    assert flags(container(one(rendered("defaults"), "Deployment", "-orchestrator")))["draft"] == "/models/draft"
    assert "no draft model" in _notes(VALUE_SETS["download-no-draft"])


def test_download_init_container_writes_the_volume_the_others_read() -> None:
    docs = rendered("download-no-draft")
    orch = one(docs, "Deployment", "-orchestrator")["spec"]["template"]["spec"]
    (init,) = orch["initContainers"]
    assert init["name"] == "download-models"
    env = {e["name"]: e for e in init["env"]}
    assert env["TARGET_REPO"]["value"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert env["TARGET_DIR"]["value"] == "/models/target" and env["DRAFT_REPO"]["value"] == ""
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert env["HF_HUB_OFFLINE"]["value"] == "0"
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]  # writable here only
    (vol,) = [v for v in orch["volumes"] if v["name"] == "models"]
    assert "readOnly" not in vol["persistentVolumeClaim"]
    (main,) = orch["containers"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in main["volumeMounts"]
    mask = one(docs, "Deployment", "-mask")["spec"]["template"]["spec"]
    (wait,) = mask["initContainers"]
    assert {e["name"]: e["value"] for e in wait["env"]}["WANT"] == "HuggingFaceTB/SmolLM2-135M-Instruct@main"
    assert all(m.get("readOnly") for m in wait["volumeMounts"] if m["name"] == "models")
    (mask_vol,) = [v for v in mask["volumes"] if v["name"] == "models"]
    assert mask_vol["persistentVolumeClaim"]["readOnly"] is True
    # Off by default: no init containers, every model volume read-only.
    for d in rendered("defaults"):
        if d["kind"] == "Deployment":
            assert "initContainers" not in d["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    "models, message",
    [
        (
            {"download": {"enabled": True, "target": "a/b"}, "volume": {"type": "hostPath"}},
            "needs models.volume.type=pvc",
        ),
        ({"download": {"enabled": True}}, "needs models.download.target"),
        ({"draft": "", "download": {"enabled": True, "target": "a/b", "draft": "a/c"}}, "no draft dir"),
    ],
)
def test_contradictory_download_values_refused(models: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render({"models": models})


@pytest.mark.parametrize(
    "download",
    [
        {"enabled": True, "target": "a/b; rm -rf /"},  # not a repo id
        {"enabled": True, "target": "a/b", "revision": "main branch"},
        {"enabled": True, "target": "a/b", "tokenSecret": {"name": "s", "key": ""}},
        {"enabled": "yes", "target": "a/b"},
    ],
)
def test_schema_refuses_bad_download_values(download: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render({"models": {"download": download}})


# ---------------------------------------------------------------- the scripts, run


def _script_and_env(container_spec: dict[str, Any], root: Path) -> tuple[str, dict[str, str]]:
    """The container's /bin/sh -c script, and its env with the model paths moved under ``root``."""
    assert container_spec["command"] == [SH, "-c"]
    env = {e["name"]: e["value"] for e in container_spec["env"] if "value" in e}
    for key in ("TARGET_DIR", "DRAFT_DIR"):
        if key in env:
            env[key] = str(root / env[key].lstrip("/"))
    return container_spec["args"][0], env


def _fake_hub(tmp_path: Path) -> tuple[Path, Path]:
    """A directory with an ``hf`` that logs its arguments and writes a config.json into
    --local-dir (or fails when FAIL_REPO names the repo), and its log."""
    bin_dir, log = tmp_path / "bin", tmp_path / "hf.log"
    bin_dir.mkdir()
    hf = bin_dir / "hf"
    hf.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {log}\n'
        'repo="$2"; shift 2\n'
        'while [ $# -gt 0 ]; do case "$1" in --local-dir) dir="$2"; shift 2;; *) shift;; esac; done\n'
        '[ "$repo" = "${FAIL_REPO:-}" ] && exit 3\n'
        'mkdir -p "$dir" && echo "{\\"repo\\": \\"$repo\\"}" > "$dir/config.json"\n'
    )
    hf.chmod(0o755)
    return bin_dir, log


def _run(script: str, env: dict[str, str], bin_dir: Path, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
    return subprocess.run([SH, "-c", script], env=full, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(not Path(SH).exists(), reason="no /bin/sh")
def test_download_script_fetches_once_and_redoes_a_cut_download(tmp_path: Path) -> None:
    values = {
        "models": {
            "target": "t",
            "draft": "d",
            "download": {"enabled": True, "target": "org/target-7b", "draft": "org/draft-1b"},
        }
    }
    init = one(render(values), "Deployment", "-orchestrator")["spec"]["template"]["spec"]["initContainers"][0]
    script, env = _script_and_env(init, tmp_path / "vol")
    bin_dir, log = _fake_hub(tmp_path)

    first = _run(script, env, bin_dir)
    assert first.returncode == 0, first.stderr
    calls = log.read_text().splitlines()
    target_dir, draft_dir = Path(env["TARGET_DIR"]), Path(env["DRAFT_DIR"])
    assert calls == [
        f"download org/target-7b --local-dir {target_dir}",
        f"download org/draft-1b --local-dir {draft_dir}",
    ]
    assert (target_dir / ".specmask-download").read_text() == "org/target-7b@main\n"
    assert (draft_dir / ".specmask-download").read_text() == "org/draft-1b@main\n"

    again = _run(script, env, bin_dir)  # a pod restart: nothing fetched again
    assert again.returncode == 0 and len(log.read_text().splitlines()) == 2
    assert "holds org/target-7b@main already" in again.stdout

    # Another repo for the target: fetched; a download that fails leaves no marker and fails the pod.
    failing = {**env, "TARGET_REPO": "org/other", "FAIL_REPO": "org/other"}
    cut = _run(script, failing, bin_dir)
    assert cut.returncode != 0
    assert not (target_dir / ".specmask-download").exists()
    retried = _run(script, {**env, "TARGET_REPO": "org/other"}, bin_dir)
    assert retried.returncode == 0, retried.stderr
    assert (target_dir / ".specmask-download").read_text() == "org/other@main\n"


@pytest.mark.skipif(not Path(SH).exists(), reason="no /bin/sh")
def test_mask_service_waits_for_the_marker_of_the_same_download(tmp_path: Path) -> None:
    docs = render({"models": {"download": {"enabled": True, "target": "org/m", "revision": "v2"}}})
    wait = one(docs, "Deployment", "-mask")["spec"]["template"]["spec"]["initContainers"][0]
    script, env = _script_and_env(wait, tmp_path / "vol")
    target_dir = Path(env["TARGET_DIR"])
    target_dir.mkdir(parents=True)
    (target_dir / ".specmask-download").write_text("org/m@v1\n")  # an older download: keep waiting
    with pytest.raises(subprocess.TimeoutExpired):
        _run(script, env, tmp_path, timeout=3)
    (target_dir / ".specmask-download").write_text("org/m@v2\n")
    done = _run(script, env, tmp_path, timeout=30)
    assert done.returncode == 0, done.stderr
