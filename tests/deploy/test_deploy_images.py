"""Static checks of the Dockerfiles (no docker engine needed) and of the
container health-check script against a real in-process gRPC health server."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from concurrent import futures
from pathlib import Path

import pytest

from specmask.orchestrator.cli import SUBCOMMANDS

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO_ROOT / "deploy" / "docker"
# image -> (subcommand it must run, port its health check probes, port it exposes)
CLI_IMAGES = {"mask-service": ("mask-service", 50051), "orchestrator": ("orchestrator", 50050)}
IMAGES = [*CLI_IMAGES, "gpu-worker"]


def instructions(image: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = (DOCKER_DIR / f"{image}.Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def exec_form(args: str) -> list[str]:
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def final_stage(image: str) -> list[tuple[str, str]]:
    ins = instructions(image)
    last_from = max(i for i, (k, _) in enumerate(ins) if k == "FROM")
    return ins[last_from:]


def command_of(image: str) -> list[str]:
    """The argv the final stage runs: ENTRYPOINT + CMD (last of each wins)."""
    stage = final_stage(image)
    entry = [exec_form(a) for k, a in stage if k == "ENTRYPOINT"]
    cmd = [exec_form(a) for k, a in stage if k == "CMD"]
    return (entry[-1] if entry else []) + (cmd[-1] if cmd else [])


@pytest.mark.parametrize("image", CLI_IMAGES)
def test_entrypoint_is_a_specmask_subcommand(image: str) -> None:
    argv = command_of(image)
    assert argv[0] == "specmask", argv
    assert argv[1] in SUBCOMMANDS, f"{argv[1]!r} is not one of {sorted(SUBCOMMANDS)}"
    assert argv[1] == CLI_IMAGES[image][0]
    assert "--port" in argv and str(CLI_IMAGES[image][1]) in argv


@pytest.mark.parametrize("image", CLI_IMAGES)
def test_image_command_binds_all_interfaces(image: str) -> None:
    """A container is reached on its own IP (probes, Services): loopback would never be Ready."""
    argv = command_of(image)
    assert argv[argv.index("--host") + 1] == "0.0.0.0", argv


def test_gpu_worker_runs_ray_and_has_specmask_installed() -> None:
    argv = command_of("gpu-worker")
    assert argv[0] == "ray" and argv[1] == "start", argv
    runs = " ".join(a for k, a in instructions("gpu-worker") if k == "RUN")
    assert re.search(r"pip install --no-deps (--no-build-isolation )?\.", runs), "specmask not installed"
    assert "import specmask.gpu_worker" in runs
    reqs = (DOCKER_DIR / "requirements" / "gpu-worker.txt").read_text()
    assert re.search(r"^ray\[default\]==", reqs, re.M) and re.search(r"^torch==\d+\.\d+\.\d+$", reqs, re.M)


@pytest.mark.parametrize("image", IMAGES)
def test_images_are_non_root_pinned_and_multistage(image: str) -> None:
    ins = instructions(image)
    froms = [a for k, a in ins if k == "FROM"]
    assert len(froms) >= 2, "multi-stage build expected"
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    for base in args.values():
        _, _, tag = base.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"unpinned base image {base}"
    users = [a for k, a in final_stage(image) if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    for _, a in ins:
        for spec in re.findall(r"pip install [^&]*", a):
            for token in spec.split()[2:]:
                if token.startswith("-") or token in (".", "/tmp/requirements.txt"):
                    continue
                assert "==" in token, f"unpinned pip install {token!r} in {image}"


@pytest.mark.parametrize("image", IMAGES)
def test_requirements_fully_pinned(image: str) -> None:
    lines = [
        ln
        for ln in (DOCKER_DIR / "requirements" / f"{image}.txt").read_text().splitlines()
        if ln and not ln.startswith(("#", "--"))
    ]
    assert lines
    bad = [ln for ln in lines if not re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[A-Za-z0-9_.+\-]+", ln)]
    assert not bad, bad
    if image == "mask-service":
        names = {ln.split("==")[0] for ln in lines}
        assert not names & {"triton", "ray"} and not any(n.startswith("nvidia-") for n in names)
        torch_pin = next((ln for ln in lines if ln.startswith("torch==")), "")
        assert "+cpu" in torch_pin, torch_pin


@pytest.mark.parametrize("image", CLI_IMAGES)
def test_healthcheck_probes_the_service_port(image: str) -> None:
    (hc,) = [a for k, a in final_stage(image) if k == "HEALTHCHECK"]
    assert "grpc-healthcheck" in hc and f"127.0.0.1:{CLI_IMAGES[image][1]}" in hc
    assert str(CLI_IMAGES[image][1]) in " ".join(a for k, a in final_stage(image) if k == "EXPOSE")


def test_lock_files_match_venv() -> None:
    lock = _load("lock", DOCKER_DIR / "lock.py")
    try:
        drift = [
            image
            for image in lock.IMAGES
            if (DOCKER_DIR / "requirements" / f"{image}.txt").read_text() != lock.render(image)
        ]
    except Exception as err:  # a distribution missing from this venv
        pytest.skip(f"venv lacks a locked distribution: {err}")
    assert not drift, f"regenerate with deploy/docker/lock.py: {drift}"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(f"_deploy_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_script_against_health_server() -> None:
    grpc = pytest.importorskip("grpc")
    health = pytest.importorskip("grpc_health.v1.health")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    hc = _load("healthcheck", REPO_ROOT / "deploy" / "healthcheck.py")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert hc.main(["--address", address]) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert hc.main(["--address", address]) == 1
        assert hc.main(["--address", address, "--service", "unknown.Service"]) == 1
    finally:
        server.stop(None)
    assert hc.main(["--address", address, "--timeout-s", "0.5"]) == 1
