"""Render, lint and validate the Helm chart offline (no cluster, no helm binary).

Core manifests are checked against the Kubernetes 1.30 OpenAPI schemas
(kubernetes-validate), the RayCluster against KubeRay's CRD schema, and the
content that matters to SpecMask (ports, probes, HPA target, GPU placement,
read-only models) is asserted directly.
"""

from __future__ import annotations

import copy
import json
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "specmask"

helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed (pip install '.[dev]')")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")

KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "sm", "llm"
MASK_PORT, ORCH_PORT, ORCH_METRICS_PORT, MASK_METRICS_PORT, ORCH_HTTP_PORT = 50051, 50050, 9090, 9091, 8000

# Every pod-level extension point, as an operator would set them.
EXTENSIONS: dict[str, Any] = {
    "env": [
        {"name": "EXTRA", "value": "1"},
        {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
    ],
    "podLabels": {"team": "llm"},
    "podAnnotations": {"note": "x"},
    "extraVolumes": [{"name": "certs", "secret": {"secretName": "certs"}}],
    "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/certs", "readOnly": True}],
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    ],
    "priorityClassName": "high",
    "runtimeClassName": "nvidia",
}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "autoscaling-off": {"maskService": {"autoscaling": {"enabled": False}, "pdb": {"enabled": False}}},
    "three-mask-replicas": {"maskService": {"autoscaling": {"enabled": False}, "replicas": 3}},
    "ingress-on": {
        "orchestrator": {
            "ingress": {"enabled": True, "host": "api.example.com", "tls": {"enabled": True, "secretName": "api-tls"}}
        }
    },
    "custom-models": {
        "models": {
            "mountPath": "/mnt/llm",
            "target": "qwen3-8b",
            "draft": "qwen3-0.6b",
            "vocabSize": 151936,
            "volume": {"type": "hostPath", "hostPath": {"path": "/data/models"}},
        },
        "maskService": {"metrics": {"enabled": True}, "autoscaling": {"maxReplicas": 20}},
        "rayCluster": {"gpuWorkers": {"minReplicas": 2, "replicas": 2, "maxReplicas": 6, "gpusPerWorker": 2}},
    },
    "everything-on": {
        "monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
        "orchestrator": {
            "http": {"ingress": {"enabled": True, "host": "openai.example.com"}},
            "ingress": {"enabled": True},
            "image": {"digest": "sha256:" + "a" * 64},
        },
        "maskService": {**EXTENSIONS, "autoscaling": {"enabled": False}, "replicas": 3, "pdb": {"minAvailable": 2}},
        "rayCluster": {"head": EXTENSIONS, "gpuWorkers": EXTENSIONS, "autoscaling": {"enabled": False}},
    },
    "download-no-draft": {
        "models": {
            "draft": "",
            "download": {
                "enabled": True,
                "target": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "revision": "main",
                "tokenSecret": {"name": "hf-token", "key": "token"},
            },
        },
        "orchestrator": {"apiKeys": {"enabled": True, "keys": ["k1"]}},
    },
    "external-ray": {
        "rayCluster": {"enabled": False},
        "orchestrator": {
            "rayAddress": "ray://ray-head.other:10001",
            "maskServiceAddresses": ["mask-0.x:50051", "mask-1.x:50051"],
        },
    },
}


@lru_cache(maxsize=1)
def _chart():
    return helm.Chart.load(str(CHART_DIR))


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    manifests = _chart().render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@cache
def _render_cached(name: str) -> str:
    return json.dumps(render(VALUE_SETS[name]))


def rendered(name: str) -> list[dict[str, Any]]:
    return json.loads(_render_cached(name))


def one(docs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def container(doc: dict[str, Any]) -> dict[str, Any]:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return c


def flags(c: dict[str, Any]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in c["args"] if a.startswith("--") and "=" in a)


# ---------------------------------------------------------------- lint + schemas


def test_lint_strict() -> None:
    report = helm.lint(str(CHART_DIR), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("name", VALUE_SETS)
def test_core_manifests_valid_for_kubernetes(name: str) -> None:
    docs = rendered(name)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ServiceAccount"} <= kinds
    for doc in docs:
        if doc["apiVersion"].startswith(("ray.io/", "monitoring.coreos.com/")):
            continue  # CRDs: RayCluster is checked against KubeRay's CRD below
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def _crd_to_jsonschema(node: Any) -> Any:
    """openAPIV3Schema -> JSON Schema: int-or-string, no x-kubernetes-* keys, and
    unknown fields refused (the API server prunes or, with strict field
    validation, rejects them) unless the CRD preserves them."""
    if isinstance(node, list):
        return [_crd_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _crd_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def raycluster_validator(kuberay_crd_path) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(kuberay_crd_path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _crd_to_jsonschema(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


@pytest.mark.shared_data
@pytest.mark.parametrize("name", ["defaults", "custom-models", "everything-on"])
def test_raycluster_valid_against_kuberay_crd(name: str, raycluster_validator) -> None:
    ray = one(rendered(name), "RayCluster")
    assert ray["apiVersion"] == "ray.io/v1"
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in raycluster_validator.iter_errors(ray)]
    assert not errors, errors[:5]


@pytest.mark.shared_data
def test_crd_conversion_catches_typos(raycluster_validator) -> None:
    ray = one(rendered("defaults"), "RayCluster")
    ray["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert not raycluster_validator.is_valid(ray)


# ---------------------------------------------------------------- content


def test_mask_service_ports_probes_and_flags() -> None:
    docs = rendered("defaults")
    dep = one(docs, "Deployment", "-mask")
    c = container(dep)
    f = flags(c)
    assert int(f["port"]) == MASK_PORT
    assert f["tokenizer"] == "/models/target"
    assert {"max-sessions", "session-ttl-s", "mask-threads"} <= f.keys()
    assert int(f["metrics-port"]) == MASK_METRICS_PORT  # on by default
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": MASK_PORT, "metrics": MASK_METRICS_PORT}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == MASK_PORT, probe
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    assert "replicas" not in dep["spec"]  # the HPA owns the replica count
    for svc_suffix in ("-mask", "-mask-headless"):
        svc = one(docs, "Service", svc_suffix)
        assert svc["spec"]["ports"][0]["port"] == MASK_PORT
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert one(docs, "Service", "-mask-headless")["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("suffix", ["-mask", "-orchestrator"])
def test_servers_bind_all_interfaces(suffix: str) -> None:
    """The kubelet probes and the Services reach the pod IP, never loopback."""
    assert flags(container(one(rendered("defaults"), "Deployment", suffix)))["host"] == "0.0.0.0"
    ipv6 = render({"listenAddress": "::"})
    assert flags(container(one(ipv6, "Deployment", suffix)))["host"] == "::"


@pytest.mark.parametrize("suffix", ["-mask", "-orchestrator"])
def test_liveness_asks_the_process_readiness_the_dependencies(suffix: str) -> None:
    """Startup/liveness name the servers' liveness service; readiness asks "" (specmask/proto/health.py)."""
    from specmask.proto import health as health_names

    c = container(one(rendered("defaults"), "Deployment", suffix))
    assert c["startupProbe"]["grpc"]["service"] == health_names.LIVENESS
    assert c["livenessProbe"]["grpc"]["service"] == health_names.LIVENESS
    assert c["readinessProbe"]["grpc"].get("service", "") == health_names.READINESS


def test_hpa_targets_mask_deployment_and_pdb_selects_it() -> None:
    docs = rendered("defaults")
    dep = one(docs, "Deployment", "-mask")
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": dep["metadata"]["name"],
    }
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_autoscaling_off_and_fixed_replicas() -> None:
    off = rendered("autoscaling-off")
    assert not [d for d in off if d["kind"] in ("HorizontalPodAutoscaler", "PodDisruptionBudget")]
    assert one(off, "Deployment", "-mask")["spec"]["replicas"] == 2
    assert one(rendered("three-mask-replicas"), "Deployment", "-mask")["spec"]["replicas"] == 3


def test_max_replicas_override_reaches_hpa() -> None:
    docs = render({"maskService": {"autoscaling": {"maxReplicas": 32}}})
    assert one(docs, "HorizontalPodAutoscaler")["spec"]["maxReplicas"] == 32


def test_orchestrator_flags_point_at_mask_headless_service_and_ray_head() -> None:
    docs = rendered("defaults")
    c = container(one(docs, "Deployment", "-orchestrator"))
    f = flags(c)
    headless = one(docs, "Service", "-mask-headless")["metadata"]["name"]
    ray = one(docs, "RayCluster")["metadata"]["name"]
    assert int(f["port"]) == ORCH_PORT and int(f["metrics-port"]) == ORCH_METRICS_PORT
    assert f["mask-service"] == f"dns:///{headless}.{NAMESPACE}.svc.cluster.local:{MASK_PORT}"
    assert f["ray-address"] == f"ray://{ray}-head-svc.{NAMESPACE}.svc.cluster.local:10001"
    assert (f["target"], f["draft"]) == ("/models/target", "/models/draft")
    assert {"num-workers", "max-queue"} <= f.keys()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == ORCH_PORT, probe
    svc = one(docs, "Service", "-orchestrator")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {
        "grpc": ORCH_PORT,
        "http": ORCH_HTTP_PORT,
        "metrics": ORCH_METRICS_PORT,
    }
    assert int(f["http-port"]) == ORCH_HTTP_PORT
    assert not [d for d in docs if d["kind"] == "Ingress"]


def test_external_ray_and_explicit_mask_addresses() -> None:
    docs = rendered("external-ray")
    assert not [d for d in docs if d["kind"] == "RayCluster"]
    f = flags(container(one(docs, "Deployment", "-orchestrator")))
    assert f["ray-address"] == "ray://ray-head.other:10001"
    assert f["mask-service"] == "mask-0.x:50051,mask-1.x:50051"
    with pytest.raises(helm.HelmError, match="rayAddress is required"):
        render({"rayCluster": {"enabled": False}})


def test_ingress_routes_grpc_to_orchestrator() -> None:
    docs = rendered("ingress-on")
    ing = one(docs, "Ingress")
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "api.example.com"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": one(docs, "Service", "-orchestrator")["metadata"]["name"], "port": {"name": "grpc"}}
    assert ing["spec"]["tls"][0]["secretName"] == "api-tls"
    assert ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"


def _pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"}
    for ray in (d for d in docs if d["kind"] == "RayCluster"):
        pods["ray-head"] = ray["spec"]["headGroupSpec"]["template"]["spec"]
        for group in ray["spec"]["workerGroupSpecs"]:
            pods[f"ray-{group['groupName']}"] = group["template"]["spec"]
    return pods


@pytest.mark.parametrize("name", ["defaults", "custom-models"])
def test_gpu_requests_on_worker_group_only(name: str) -> None:
    docs = rendered(name)
    gpus = {
        pod: [
            c["resources"].get(k, {}).get("nvidia.com/gpu") for c in spec["containers"] for k in ("requests", "limits")
        ]
        for pod, spec in _pod_specs(docs).items()
    }
    want = VALUE_SETS[name].get("rayCluster", {}).get("gpuWorkers", {}).get("gpusPerWorker", 1)
    assert gpus.pop("ray-gpu") == [want, want]
    assert all(v is None for vals in gpus.values() for v in vals), gpus
    ray = one(docs, "RayCluster")
    (group,) = ray["spec"]["workerGroupSpecs"]
    assert "replicas" not in group  # the autoscaler owns the count
    assert group["minReplicas"] <= group["maxReplicas"]
    assert ray["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"


@pytest.mark.parametrize("name", ["defaults", "custom-models"])
def test_models_mounted_read_only_everywhere(name: str) -> None:
    docs = rendered(name)
    mount_path = VALUE_SETS[name].get("models", {}).get("mountPath", "/models")
    for pod, spec in _pod_specs(docs).items():
        (vol,) = [v for v in spec["volumes"] if v["name"] == "models"]
        if "persistentVolumeClaim" in vol:
            assert vol["persistentVolumeClaim"]["readOnly"] is True, pod
        else:
            assert vol["hostPath"]["path"], pod
        for c in spec["containers"]:
            (m,) = [m for m in c["volumeMounts"] if m["name"] == "models"]
            assert m == {"name": "models", "mountPath": mount_path, "readOnly": True}, pod


def test_ray_start_params_extend_the_groups() -> None:
    docs = render(
        {
            "rayCluster": {
                "head": {"rayStartParams": {"object-store-memory": 100000000, "num-cpus": "4"}},
                "gpuWorkers": {"rayStartParams": {"object-store-memory": "200000000"}},
            }
        }
    )
    ray = one(docs, "RayCluster")["spec"]
    head = ray["headGroupSpec"]["rayStartParams"]
    assert head["object-store-memory"] == "100000000" and head["dashboard-host"] == "0.0.0.0"
    assert (head["num-cpus"], head["num-gpus"]) == ("0", "0")  # the head never takes actors
    assert ray["workerGroupSpecs"][0]["rayStartParams"] == {"object-store-memory": "200000000"}


def test_custom_models_paths_reach_the_flags() -> None:
    docs = rendered("custom-models")
    mask = flags(container(one(docs, "Deployment", "-mask")))
    orch = flags(container(one(docs, "Deployment", "-orchestrator")))
    assert mask["tokenizer"] == "/mnt/llm/qwen3-8b:151936"
    assert int(mask["metrics-port"]) == 9091
    assert (orch["target"], orch["draft"]) == ("/mnt/llm/qwen3-8b", "/mnt/llm/qwen3-0.6b")


def test_pods_run_as_non_root() -> None:
    for pod, spec in _pod_specs(rendered("defaults")).items():
        assert spec["securityContext"]["runAsNonRoot"] is True, pod
        assert spec["securityContext"]["runAsUser"] != 0, pod


def test_notes_tell_how_to_call_the_api() -> None:
    notes = _chart().render({}, name=RELEASE, namespace=NAMESPACE)["specmask/templates/NOTES.txt"]
    assert "specmask generate --address" in notes and "port-forward" in notes
    assert "maskService.autoscaling.maxReplicas" in notes


# ---------------------------------------------------------------- bad values refused

BAD_VALUES = {
    "port-not-int": {"maskService": {"port": "50051"}},
    "port-out-of-range": {"orchestrator": {"port": 70000}},
    "max-replicas-zero": {"maskService": {"autoscaling": {"maxReplicas": 0}}},
    "cpu-target-over-100": {"maskService": {"autoscaling": {"targetCPUUtilizationPercentage": 150}}},
    "unknown-volume-type": {"models": {"volume": {"type": "nfs"}}},
    "unknown-top-level-key": {"maskservice": {}},
    "typo-in-mask-key": {"maskService": {"autoscale": {"enabled": True}}},
    "pull-policy-enum": {"orchestrator": {"image": {"pullPolicy": "Sometimes"}}},
    "relative-mount-path": {"models": {"mountPath": "models"}},
    "absolute-model-dir": {"models": {"target": "/abs"}},
    "gpus-zero": {"rayCluster": {"gpuWorkers": {"gpusPerWorker": 0}}},
    "bad-ray-address": {"orchestrator": {"rayAddress": "http://head:8265"}},
    "bad-service-type": {"orchestrator": {"service": {"type": "ExternalName"}}},
    "bad-cpu-quantity": {"maskService": {"resources": {"requests": {"cpu": "two"}, "limits": {}}}},
    "empty-image-tag": {"rayCluster": {"image": {"tag": ""}}},
    "loopback-listen-address": {"listenAddress": "127.0.0.1"},
    "bad-digest": {"orchestrator": {"image": {"digest": "latest"}}},
    "bad-dtype": {"orchestrator": {"dtype": "int8"}},
    "bad-upgrade-strategy": {"rayCluster": {"upgradeStrategy": "RollingUpdate"}},
    "env-without-name": {"maskService": {"env": [{"value": "1"}]}},
    "bad-scrape-interval": {"monitoring": {"serviceMonitor": {"interval": "often"}}},
    "num-workers-zero": {"orchestrator": {"numWorkers": 0}},
    "unknown-network-policy-key": {"networkPolicy": {"egress": True}},
    "bad-log-format": {"logFormat": "xml"},
}


@pytest.mark.parametrize("name", BAD_VALUES)
def test_schema_refuses_bad_values(name: str) -> None:
    with pytest.raises(helm.HelmValuesError):
        _chart().render(copy.deepcopy(BAD_VALUES[name]), name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"maskService": {"autoscaling": {"minReplicas": 5, "maxReplicas": 3}}}, "minReplicas must be <= maxReplicas"),
        ({"rayCluster": {"gpuWorkers": {"minReplicas": 5, "maxReplicas": 3}}}, "minReplicas <= maxReplicas"),
        (
            {"rayCluster": {"autoscaling": {"enabled": False}, "gpuWorkers": {"minReplicas": 3, "replicas": 1}}},
            "minReplicas <= replicas <= maxReplicas",
        ),
        ({"maskService": {"pdb": {"minAvailable": 2}}}, r"minAvailable \(2\) must be below the replica floor \(2"),
        (
            {"maskService": {"autoscaling": {"enabled": False}, "replicas": 2, "pdb": {"minAvailable": 3}}},
            r"must be below the replica floor \(2: replicas\)",
        ),
        ({"orchestrator": {"numWorkers": 5}}, r"numWorkers \(5\) x orchestrator.replicas \(2\)"),
        ({"orchestrator": {"numWorkers": 2, "replicas": 3}}, "more GPUs than rayCluster.gpuWorkers can ever have"),
        ({"orchestrator": {"drainSeconds": 60}}, r"shutdownDelaySeconds \+ drainSeconds \(5 \+ 60\) must be below"),
        ({"maskService": {"drainSeconds": 25}}, r"preStopSleepSeconds \+ drainSeconds \(5 \+ 25\)"),
        ({"maskService": {"metrics": {"port": 50051}}}, "metrics.port must differ"),
    ],
)
def test_inconsistent_bounds_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)


@pytest.mark.parametrize("component, suffix", [("mask-service", "-mask"), ("orchestrator", "-orchestrator")])
def test_rendered_args_parse_with_the_real_cli(component: str, suffix: str) -> None:
    """Contract with the service code: the chart's flags are the CLI's flags."""
    cli = pytest.importorskip("specmask.orchestrator.cli")
    module_path = cli.SUBCOMMANDS[component][0]
    try:
        __import__(module_path)
    except ImportError as err:
        pytest.skip(f"{module_path} not importable here: {err}")
    args = container(one(rendered("custom-models"), "Deployment", suffix))["args"]
    if component == "mask-service":  # metrics flag is optional in the service
        args = [a for a in args if not a.startswith("--metrics-port")]
    argv = [component, *args]
    parsed = cli.build_parser(argv).parse_args(argv)
    assert parsed.port == {"mask-service": MASK_PORT, "orchestrator": ORCH_PORT}[component]
