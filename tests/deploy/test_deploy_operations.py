"""Render tests for what operators need on day two: rollouts, Ray security, NetworkPolicies,
monitoring, extension points, and the schema describing every value."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from tests.deploy.test_deploy_chart import (
    CHART_DIR,
    EXTENSIONS,
    MASK_PORT,
    _pod_specs,
    container,
    flags,
    one,
    render,
    rendered,
)

DEPLOYMENTS = ["-mask", "-orchestrator"]


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pod_labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    out = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] == "Deployment"
    }
    ray = one(docs, "RayCluster")["spec"]
    out["ray-head"] = ray["headGroupSpec"]["template"]["metadata"]["labels"]
    out["ray-gpu"] = ray["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    return out


# ---------------------------------------------------------------- rollouts


def test_orchestrator_rolls_one_pod_at_a_time_and_adopts_workers() -> None:
    """Two replicas rolled one at a time, never a surge pod (it would ask for new GPUs): the new
    pod adopts the pooled workers the old one released (docs/deployment.md)."""
    dep = one(rendered("defaults"), "Deployment", "-orchestrator")
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    f = flags(container(dep))
    assert f["worker-pool"] == dep["metadata"]["name"].removesuffix("-orchestrator")
    assert "worker-pool" not in flags(
        container(one(render({"orchestrator": {"workerPool": {"enabled": False}}}), "Deployment", "-orchestrator"))
    )


def test_a_long_release_name_still_makes_a_valid_pool_name() -> None:
    from specmask.orchestrator.config import OrchestratorConfig

    docs = render({"fullnameOverride": "a-very-long-release-name-that-goes-on-x-"})
    pool = flags(container(one(docs, "Deployment", "-orchestrator")))["worker-pool"]
    assert len(pool) <= 40
    OrchestratorConfig(target_dir="t", mask_service_addresses=("m:1",), worker_pool=pool)  # accepted


def test_worker_autoscaling_flags_use_the_gpu_groups_max() -> None:
    f = flags(container(one(rendered("defaults"), "Deployment", "-orchestrator")))
    # 2 GPU pods at least, 4 at most, 2 replicas: 1 worker each at start, up to 2 each.
    assert (f["num-workers"], f["min-workers"], f["max-workers"]) == ("1", "1", "2")
    assert (f["scale-up-queue-wait-s"], f["scale-up-after-s"], f["scale-down-idle-s"]) == ("2", "10", "300")
    docs = render({"orchestrator": {"replicas": 1}, "rayCluster": {"gpuWorkers": {"maxReplicas": 6}}})
    f = flags(container(one(docs, "Deployment", "-orchestrator")))
    assert (f["num-workers"], f["min-workers"], f["max-workers"]) == ("2", "2", "6")
    off = render({"orchestrator": {"workerAutoscaling": {"enabled": False}}})
    assert "max-workers" not in flags(container(one(off, "Deployment", "-orchestrator")))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"orchestrator": {"workerAutoscaling": {"maxWorkers": 3}}}, r"maxWorkers \(3\) x orchestrator.replicas \(2\)"),
        ({"orchestrator": {"numWorkers": 2, "workerAutoscaling": {"maxWorkers": 1}}}, "minWorkers"),
        ({"orchestrator": {"workerAutoscaling": {"minWorkers": 2}}}, r"minWorkers \(2\) <= numWorkers \(1\)"),
    ],
)
def test_worker_autoscaling_contradictions_are_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=message):
        render(values)


def test_grammar_fallback_value() -> None:
    assert flags(container(one(rendered("defaults"), "Deployment", "-orchestrator")))["grammar-fallback"] == "checked"
    docs = render({"orchestrator": {"grammarFallback": "refuse"}})
    assert flags(container(one(docs, "Deployment", "-orchestrator")))["grammar-fallback"] == "refuse"
    with pytest.raises(Exception, match="grammarFallback"):
        render({"orchestrator": {"grammarFallback": "off"}})


def test_drain_time_flags_below_grace_period() -> None:
    docs = rendered("defaults")
    for suffix in DEPLOYMENTS:
        dep = one(docs, "Deployment", suffix)
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        c = container(dep)
        drain = float(flags(c)["shutdown-grace-s"]) + float(flags(c).get("shutdown-delay-s", 0))
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert pre_stop + drain < grace, suffix


def test_num_workers_derived_from_the_gpu_group() -> None:
    f = flags(container(one(rendered("defaults"), "Deployment", "-orchestrator")))
    assert f["num-workers"] == "1"  # minReplicas 2 x gpusPerWorker 1, shared by 2 replicas
    docs = render({"rayCluster": {"gpuWorkers": {"minReplicas": 2, "gpusPerWorker": 4, "maxReplicas": 2}}})
    assert flags(container(one(docs, "Deployment", "-orchestrator")))["num-workers"] == "4"
    docs = render({"orchestrator": {"replicas": 1}, "rayCluster": {"gpuWorkers": {"gpusPerWorker": 4}}})
    assert flags(container(one(docs, "Deployment", "-orchestrator")))["num-workers"] == "8"
    docs = render({"orchestrator": {"numWorkers": 2}})  # x 2 replicas, within maxReplicas 4 x 1
    assert flags(container(one(docs, "Deployment", "-orchestrator")))["num-workers"] == "2"


def test_raycluster_upgrade_strategy_and_replicas_only_without_autoscaler() -> None:
    ray = one(rendered("defaults"), "RayCluster")["spec"]
    assert ray["upgradeStrategy"] == {"type": "Recreate"}
    assert ray["enableInTreeAutoscaling"] is True and "replicas" not in ray["workerGroupSpecs"][0]
    fixed = one(render({"rayCluster": {"autoscaling": {"enabled": False}}}), "RayCluster")["spec"]
    assert fixed["enableInTreeAutoscaling"] is False and fixed["workerGroupSpecs"][0]["replicas"] == 2


def test_dtype_defaults_to_bf16_and_is_a_value() -> None:
    assert flags(container(one(rendered("defaults"), "Deployment", "-orchestrator")))["dtype"] == "bfloat16"
    docs = render({"orchestrator": {"dtype": "float32"}})
    assert flags(container(one(docs, "Deployment", "-orchestrator")))["dtype"] == "float32"


@pytest.mark.parametrize("suffix", DEPLOYMENTS)
def test_log_format_value(suffix: str) -> None:
    assert flags(container(one(rendered("defaults"), "Deployment", suffix)))["log-format"] == "text"
    assert flags(container(one(render({"logFormat": "json"}), "Deployment", suffix)))["log-format"] == "json"


# ---------------------------------------------------------------- Ray security


def test_ray_pods_hardened_like_the_others() -> None:
    specs = _pod_specs(rendered("defaults"))
    for pod, spec in specs.items():
        sec = spec["securityContext"]
        assert sec["runAsNonRoot"] is True and sec["runAsUser"] != 0, pod
        assert sec["seccompProfile"] == {"type": "RuntimeDefault"}, pod
        for c in spec["containers"]:
            csec = c["securityContext"]
            assert csec["allowPrivilegeEscalation"] is False, pod
            assert csec["capabilities"] == {"drop": ["ALL"]}, pod
    assert specs["ray-gpu"]["automountServiceAccountToken"] is False
    # The head mounts a token only for the autoscaler sidecar, which calls the API server.
    assert specs["ray-head"]["automountServiceAccountToken"] is True
    off = _pod_specs(render({"rayCluster": {"autoscaling": {"enabled": False}}}))
    assert off["ray-head"]["automountServiceAccountToken"] is False
    autoscaler = one(rendered("defaults"), "RayCluster")["spec"]["autoscalerOptions"]["securityContext"]
    assert autoscaler["capabilities"] == {"drop": ["ALL"]} and autoscaler["runAsNonRoot"] is True


def _orchestrator_env(docs: list[dict[str, Any]]) -> dict[str, Any]:
    c = container(one(docs, "Deployment", "-orchestrator"))
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def test_ray_token_auth_on_by_default_and_shared_with_the_orchestrator() -> None:
    docs = rendered("defaults")
    auth = one(docs, "RayCluster")["spec"]["authOptions"]
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-ray-auth")]
    assert auth == {"mode": "token", "secretName": secret["metadata"]["name"]}
    assert len(base64.b64decode(secret["data"]["auth_token"])) >= 32
    env = _orchestrator_env(docs)
    assert env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "auth_token"}}


def test_ray_token_auth_existing_secret_and_off() -> None:
    docs = render({"rayCluster": {"auth": {"existingSecret": "my-ray-token"}}})
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-ray-auth")]
    assert one(docs, "RayCluster")["spec"]["authOptions"]["secretName"] == "my-ray-token"
    assert _orchestrator_env(docs)["RAY_AUTH_TOKEN"]["secretKeyRef"]["name"] == "my-ray-token"
    off = render({"rayCluster": {"auth": {"enabled": False}}})
    assert "authOptions" not in one(off, "RayCluster")["spec"]
    assert "RAY_AUTH_TOKEN" not in _orchestrator_env(off)


def _env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def test_mask_token_shared_by_the_service_and_its_callers() -> None:
    """The mask service checks SPECMASK_MASK_TOKEN; the orchestrator and the GPU workers send it."""
    docs = rendered("defaults")
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-mask-token")]
    ref = {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "token"}}
    assert len(base64.b64decode(secret["data"]["token"])) >= 32
    ray = one(docs, "RayCluster")["spec"]
    holders = {
        "mask-service": container(one(docs, "Deployment", "-mask")),
        "orchestrator": container(one(docs, "Deployment", "-orchestrator")),
        "gpu-worker": ray["workerGroupSpecs"][0]["template"]["spec"]["containers"][0],
    }
    for name, c in holders.items():
        assert _env_of(c)["SPECMASK_MASK_TOKEN"] == ref, name
    off = render({"maskService": {"auth": {"enabled": False}}})
    assert not [d for d in off if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-mask-token")]
    assert "SPECMASK_MASK_TOKEN" not in _env_of(container(one(off, "Deployment", "-mask")))
    mine = render({"maskService": {"auth": {"existingSecret": "mine"}}})
    assert (
        _env_of(container(one(mine, "Deployment", "-orchestrator")))["SPECMASK_MASK_TOKEN"]["secretKeyRef"]["name"]
        == "mine"
    )


# ---------------------------------------------------------------- NetworkPolicies


def _policy(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (p,) = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy"
        and d["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
    ]
    return p["spec"]


def _peers(rule: dict[str, Any], labels: dict[str, dict[str, str]]) -> set[str]:
    """Which pods of the release a rule's `from` admits (all of them when it has none)."""
    if "from" not in rule:
        return set(labels)
    return {
        pod
        for pod, lab in labels.items()
        for peer in rule["from"]
        if _labels_match(peer["podSelector"]["matchLabels"], lab)
    }


def test_network_policies_on_by_default() -> None:
    docs = rendered("defaults")
    labels = _pod_labels(docs)
    orch, mask = "sm-specmask-orchestrator", "sm-specmask-mask"
    # Mask service: gRPC only from the GPU workers and the orchestrator; metrics from anyone.
    spec = _policy(docs, "mask-service")
    assert _labels_match(spec["podSelector"]["matchLabels"], labels[mask])
    grpc_rule = next(r for r in spec["ingress"] if {"port": MASK_PORT, "protocol": "TCP"} in r["ports"])
    assert _peers(grpc_rule, labels) == {"ray-gpu", orch}
    # Ray head: client port and dashboard only from the orchestrator, all ports from Ray pods.
    spec = _policy(docs, "ray-head")
    assert _labels_match(spec["podSelector"]["matchLabels"], labels["ray-head"])
    client_rules = [r for r in spec["ingress"] if any(p["port"] in (10001, 8265) for p in r.get("ports", []))]
    assert [_peers(r, labels) for r in client_rules] == [{orch}]
    unrestricted_ports = [r for r in spec["ingress"] if "ports" not in r]
    assert [_peers(r, labels) for r in unrestricted_ports] == [{"ray-head", "ray-gpu"}]
    # Ray workers: only Ray pods (plus metrics).
    spec = _policy(docs, "ray-gpu-worker")
    assert [_peers(r, labels) for r in spec["ingress"] if "ports" not in r] == [{"ray-head", "ray-gpu"}]
    assert not [d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


def test_network_policy_metrics_peers() -> None:
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    docs = render({"networkPolicy": {"metricsFrom": [peer]}})
    metrics_rule = next(r for r in _policy(docs, "mask-service")["ingress"] if r["ports"][0]["port"] == 9091)
    assert metrics_rule["from"] == [peer]


# ---------------------------------------------------------------- monitoring


def test_monitors_optional_and_pointing_at_metrics_ports() -> None:
    assert not [d for d in rendered("defaults") if d["apiVersion"].startswith("monitoring.coreos.com/")]
    docs = rendered("everything-on")
    sm = one(docs, "ServiceMonitor")
    (endpoint,) = sm["spec"]["endpoints"]
    scraped = [
        s
        for s in docs
        if s["kind"] == "Service"
        and _labels_match(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        and any(p["name"] == endpoint["port"] for p in s["spec"]["ports"])
    ]
    assert sorted(s["metadata"]["name"] for s in scraped) == ["sm-specmask-mask", "sm-specmask-orchestrator"]
    pm = one(docs, "PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    for pod, spec in _pod_specs(docs).items():
        if pod.startswith("ray-"):
            assert any(p["name"] == "metrics" for p in spec["containers"][0]["ports"]), pod


# ---------------------------------------------------------------- HTTP API


def test_http_api_exposed_in_service_and_its_own_ingress() -> None:
    docs = rendered("everything-on")
    c = container(one(docs, "Deployment", "-orchestrator"))
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == int(flags(c)["http-port"])
    ing = one(docs, "Ingress", "-http")
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "openai.example.com"
    assert rule["http"]["paths"][0]["backend"]["service"]["port"] == {"name": "http"}
    assert "nginx.ingress.kubernetes.io/backend-protocol" not in ing["metadata"].get("annotations", {})
    off = render({"orchestrator": {"http": {"enabled": False}}})
    c = container(one(off, "Deployment", "-orchestrator"))
    assert flags(c)["http-port"] == "-1"
    assert "http" not in {p["name"] for p in one(off, "Service", "-orchestrator")["spec"]["ports"]}


# ---------------------------------------------------------------- extension points


def test_extension_points_reach_every_pod() -> None:
    docs = rendered("everything-on")
    ray = one(docs, "RayCluster")["spec"]
    templates = {d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] == "Deployment"}
    templates["ray-head"] = ray["headGroupSpec"]["template"]
    templates["ray-gpu"] = ray["workerGroupSpecs"][0]["template"]
    extended = {"sm-specmask-mask", "ray-head", "ray-gpu"}
    for pod, template in templates.items():
        if pod not in extended:
            continue
        spec, (c,) = template["spec"], template["spec"]["containers"]
        assert template["metadata"]["labels"]["team"] == "llm", pod
        assert template["metadata"]["annotations"]["note"] == "x", pod
        assert spec["priorityClassName"] == "high" and spec["runtimeClassName"] == "nvidia", pod
        assert spec["topologySpreadConstraints"] == EXTENSIONS["topologySpreadConstraints"], pod
        assert EXTENSIONS["extraVolumes"][0] in spec["volumes"], pod
        assert EXTENSIONS["extraVolumeMounts"][0] in c["volumeMounts"], pod
        assert [e for e in c["env"] if e["name"] in ("EXTRA", "FROM_SECRET")] == EXTENSIONS["env"], pod
    image = container(one(docs, "Deployment", "-orchestrator"))["image"]
    assert image == "ghcr.io/specmask/orchestrator@sha256:" + "a" * 64


def test_default_mask_spread_unless_overridden() -> None:
    spec = one(rendered("defaults"), "Deployment", "-mask")["spec"]["template"]["spec"]
    (tsc,) = spec["topologySpreadConstraints"]
    assert tsc["topologyKey"] == "kubernetes.io/hostname"


# ---------------------------------------------------------------- schema


def _undescribed(node: Any, path: str = "") -> list[str]:
    out = []
    if isinstance(node, dict):
        for key, sub in node.get("properties", {}).items():
            if "description" not in sub:
                out.append(f"{path}.{key}")
            out += _undescribed(sub, f"{path}.{key}")
    return out


def test_every_value_is_described() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert _undescribed(schema) == []


@pytest.mark.parametrize("component", ["maskService", "orchestrator"])
def test_every_pod_extension_point_is_in_the_schema(component: str) -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    props = schema["properties"][component]["properties"]
    assert set(EXTENSIONS) <= set(props)
    assert "digest" in schema["definitions"]["image"]["properties"]
