"""The rendered chart, run: every pod as local processes in its own network namespace.

See tests/deploy/pods.py for what stands in for the cluster. The release is
rendered with the tiny local model pair, its Deployments and RayCluster groups
are started with the images' commands plus the rendered args, the kubelet's
probes run until every pod is Ready, then a schema-constrained request goes to
the orchestrator Service from outside the namespaces; then one mask pod is
killed and requests must still complete (the router fails over, then the
headless Service drops the dead pod); then the orchestrator Deployment is rolled, one pod
at a time, while a client keeps sending and streaming requests: none fails and the new pods
adopt the old ones' GPU workers (no model load).

Needs root (network and mount namespaces); skips with the reason otherwise.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.pods import Cluster, Pod, netns_unavailable_reason

pytestmark = pytest.mark.slow
helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed (pip install '.[dev]')")
pytest.importorskip("ray", reason="ray not installed (pip install '.[gpu]')")

logger = logging.getLogger(__name__)

CHART_DIR = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "specmask"
RELEASE, NAMESPACE = "sm", "llm"
# Six pods (two orchestrator replicas) start at once; a saturated two-core box needs minutes.
READY_TIMEOUT_S = 600.0
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "mid", "high"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    },
    "required": ["ok", "level", "flags"],
    "additionalProperties": False,
}
# Only what this box needs: a small Ray object store (shared/data/README.md), one
# mask thread, one Ray worker pod holding both orchestrator replicas' workers (two
# "GPUs": Ray schedules by the count; the workers run on the CPU); everything else is
# the chart's defaults (two orchestrator replicas, pooled workers, RollingUpdate).
VALUES: dict[str, Any] = {
    "maskService": {"maskThreads": 1},
    "orchestrator": {"extraArgs": ["--default-max-tokens=96", "--worker-start-timeout-s=300"]},
    "rayCluster": {
        "head": {"rayStartParams": {"object-store-memory": "80000000"}},
        "gpuWorkers": {
            "rayStartParams": {"object-store-memory": "80000000"},
            "minReplicas": 1,
            "replicas": 1,
            "maxReplicas": 1,
            "gpusPerWorker": 2,
        },
    },
}
ROLL_TIMEOUT_S = 300.0


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    manifests = helm.Chart.load(str(CHART_DIR)).render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)
    return [
        d
        for path, text in sorted(manifests.items())
        if not path.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if d
    ]


def replicas_for(docs: list[dict[str, Any]]) -> Any:
    """A Deployment's pod count: spec.replicas, or its HPA's minReplicas (the HPA owns the count)."""

    def count(dep: dict[str, Any]) -> int:
        if "replicas" in dep["spec"]:
            return int(dep["spec"]["replicas"])
        (hpa,) = [
            d
            for d in docs
            if d["kind"] == "HorizontalPodAutoscaler" and d["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
        ]
        return int(hpa["spec"]["minReplicas"])

    return count


def kuberay_default_probe(pod: Pod, cluster: Cluster) -> tuple[bool, str]:
    """Ray containers declare no probes, so KubeRay injects its own: an exec of wget against
    the dashboard agent (and, on the head, the dashboard's GCS check). Those endpoints exist
    only with ray[default] (the image has it); a dev venv with minimal Ray has no dashboard,
    so there the GCS itself is checked with `ray health-check`, inside the pod's namespace."""
    if "ray.io/node-type" not in pod.labels:
        return True, "not a Ray pod"
    head = pod.labels["ray.io/node-type"] == "head"
    if importlib.util.find_spec("aiohttp_cors") is not None:
        check = "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
        if head:
            check += " && wget -T 2 -q -O- http://localhost:8265/api/gcs_healthz | grep success"
        spec = {"exec": {"command": ["bash", "-c", check]}, "timeoutSeconds": 5}
    else:
        gcs = "127.0.0.1:6379" if head else f"{cluster.services[-1].name}.{NAMESPACE}.svc.cluster.local:6379"
        spec = {"exec": {"command": [str(Path(sys.prefix) / "bin" / "ray"), "health-check", "--address", gcs]}}
        spec["timeoutSeconds"] = 20
    return cluster.probe(pod, spec)


def generate(address: str, n: int) -> list[Any]:
    from specmask.orchestrator.client import OrchestratorClient, build_request

    def one(i: int) -> Any:
        with OrchestratorClient(address) as client:
            return client.generate(build_request(f"record {i}:\n", schema=SCHEMA, seed=i, max_tokens=96), timeout_s=180)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def assert_schema_valid(responses: list[Any]) -> None:
    from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb

    for r in responses:
        assert r.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE, (r.finish_reason, r.error, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMA)


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Cluster:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    # Not under /tmp: each pod gets its own /tmp (an emptyDir), which would hide it.
    workdir = Path(tempfile.mkdtemp(prefix="specmask-pods-", dir="/var/tmp"))
    os.chmod(workdir, 0o755)
    # Ray's start-up waits (the GCS port file, the raylet's registration) are 30 s by default;
    # several pods starting at once on a busy two-core CI box can take longer than that.
    ray_env = {"RAY_gcs_server_port_wait_time_s": "120", "RAY_raylet_start_wait_time_s": "120"}
    c = Cluster(NAMESPACE, workdir, env_overrides={"RAY_USAGE_STATS_ENABLED": "0", **ray_env})

    def teardown() -> None:
        c.close()
        if not os.environ.get("SPECMASK_KEEP_PODS"):  # set it to keep the pods' logs for a look
            shutil.rmtree(workdir, ignore_errors=True)

    request.addfinalizer(teardown)
    return c


def test_release_runs_as_pods(cluster: Cluster) -> None:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    models = cluster.workdir / "models"
    build_tiny_model_pair(models)
    for path in models.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    values = copy.deepcopy(VALUES)
    values["models"] = {"mountPath": str(models), "volume": {"type": "hostPath", "hostPath": {"path": str(models)}}}
    docs = render(values)
    cluster.add_manifests(docs, replicas_for(docs))
    names = sorted(p.name for p in cluster.pods)
    assert len([n for n in names if "-mask-" in n]) == 2, names
    assert len([n for n in names if "-orchestrator-" in n]) == 2 and len(names) == 6, names
    cluster.create_network()
    for pod in cluster.pods:
        cluster.start(pod)
    cluster.run_kubelets(extra_ready=lambda pod: kuberay_default_probe(pod, cluster))
    cluster.wait_ready(READY_TIMEOUT_S)
    restarted = {p.name: p.restarts for p in cluster.pods if p.restarts}
    if restarted:  # allowed, as in a cluster, but worth seeing in the output
        logger.warning("containers restarted before all pods were Ready: %s", restarted)

    # Liveness passes for every pod that declares it.
    for pod in cluster.pods:
        live = pod.containers[0].probes.get("livenessProbe")
        if live is not None:
            ok, why = cluster.probe(pod, live)
            assert ok, f"{pod.name} liveness: {why}"

    orch_svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-orchestrator"))
    address = cluster.service_address(orch_svc["metadata"]["name"], orch_svc["spec"]["ports"][0]["port"])
    assert_schema_valid(generate(address, 2))

    # The other ports the Services name answer on the pod IPs too: the HTTP API
    # (orchestrator Service "http") and each mask replica's metrics (on by default).
    http = next(p for p in orch_svc["spec"]["ports"] if p["name"] == "http")
    http_address = cluster.service_address(orch_svc["metadata"]["name"], http["port"])
    with urllib.request.urlopen(f"http://{http_address}/v1/models", timeout=30) as resp:
        assert resp.status == 200 and json.loads(resp.read())["data"], "HTTP API through the Service"
    for pod in (p for p in cluster.pods if "-mask-" in p.name):
        with urllib.request.urlopen(f"http://{pod.ip}:{pod.port('metrics')}/metrics", timeout=30) as resp:
            assert b"specmask_mask_sessions" in resp.read(), pod.name

    # A mask pod dies (SIGKILL, no drain): requests still complete, first through the
    # router's failover while DNS still names the dead pod, then without it.
    mask_pods = [p for p in cluster.pods if "-mask-" in p.name]
    cluster.kill(mask_pods[0])
    assert_schema_valid(generate(address, 3))
    cluster.sync_endpoints()
    assert_schema_valid(generate(address, 2))

    roll_the_orchestrator(cluster, orch_svc["metadata"]["name"], orch_svc["spec"]["ports"][0]["port"])


def gpu_worker_pids(cluster: Cluster) -> set[int]:
    """Pids of the GpuWorker actor processes in the Ray pods (Ray titles them ray::GpuWorker)."""
    pids = set()
    for pod in cluster.pods:
        if "ray.io/node-type" not in pod.labels or pod.killed:
            continue
        for pid in subprocess.run(["ip", "netns", "pids", pod.netns], capture_output=True, text=True).stdout.split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(b"ray::GpuWorker"):
                pids.add(int(pid))
    return pids


class Load:
    """A client of the orchestrator Service: requests back to back on a few threads, each to a
    ready endpoint picked at random (as kube-proxy does), every other one streamed."""

    def __init__(self, cluster: Cluster, service: str, port: int, threads: int = 3) -> None:
        self.cluster, self.service, self.port = cluster, service, port
        self.ok = 0
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def _address(self) -> str:
        (svc,) = [s for s in self.cluster.services if s.name == self.service]
        pods = self.cluster.endpoints(svc)
        if not pods:
            raise RuntimeError(f"Service {self.service} has no ready endpoints")
        pod = random.choice(pods)
        return f"{pod.ip}:{pod.port(svc.ports[self.port])}"

    def _run(self, thread: int) -> None:
        from specmask.orchestrator.client import OrchestratorClient, build_request
        from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb

        n = thread
        while not self._stop.is_set():
            n += len(self._threads)
            address = "?"
            try:
                address = self._address()
                request = build_request(f"record {n}:\n", schema=SCHEMA, seed=n, max_tokens=96)
                with OrchestratorClient(address) as client:
                    if n % 2:
                        r = client.stream_all(request, timeout_s=180)
                        reason, text, error = r.finish_reason, r.text, r.error
                    else:
                        resp = client.generate(request, timeout_s=180)
                        reason, text, error = resp.finish_reason, resp.text, resp.error
                assert reason == pb.FINISH_REASON_GRAMMAR_COMPLETE, (reason, error, text)
                jsonschema.validate(json.loads(text), SCHEMA)
            except Exception as exc:  # a refused, cut or invalid request is a failure
                with self.lock:
                    self.failures.append(f"{address}: {exc!r}")
                continue
            with self.lock:
                self.ok += 1

    def wait_for(self, ok: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ok < ok:
            assert not self.failures, self.failures
            assert time.monotonic() < deadline, f"only {self.ok} requests completed"
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(200)


def roll_the_orchestrator(cluster: Cluster, service: str, port: int) -> None:
    """A rolling update of the orchestrator Deployment (maxSurge 0, maxUnavailable 1) while a
    client streams and sends requests: none fails, and the new pods adopt the old pods' GPU
    workers (the same processes: no model is loaded again)."""
    workers = gpu_worker_pids(cluster)
    assert len(workers) == 2, workers
    load = Load(cluster, service, port)
    try:
        load.wait_for(3, ROLL_TIMEOUT_S)
        for old in [p for p in cluster.pods if "-orchestrator-" in p.name and not p.killed]:
            new = cluster.replace_pod(old, extra_ready=lambda pod: kuberay_default_probe(pod, cluster))
            deadline = time.monotonic() + ROLL_TIMEOUT_S
            while not (new.ready and old.terminated):  # the Deployment controller's next step waits for both
                assert not (new.failure or old.failure), cluster.describe([new, old])
                assert time.monotonic() < deadline, "rollout step did not finish:\n" + cluster.describe([new, old])
                assert not load.failures, load.failures
                time.sleep(0.5)
            assert "1 adopted, 0 created" in new.log_path.read_text(), new.log_tail()  # type: ignore[union-attr]
            load.wait_for(load.ok + 3, ROLL_TIMEOUT_S)
    finally:
        load.stop()
    assert not load.failures, load.failures
    assert gpu_worker_pids(cluster) == workers, "a GPU worker was started again (a model load)"
