"""The chart's API-key Secret, the orchestrator's NetworkPolicy, CORS and the per-client cap,
rendered offline (no cluster, no helm binary) and checked against the real CLI's flags."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from specmask.orchestrator.auth_keys import load_api_keys
from tests.deploy.test_deploy_chart import (
    ORCH_HTTP_PORT,
    ORCH_METRICS_PORT,
    ORCH_PORT,
    container,
    flags,
    helm,
    one,
    render,
    rendered,
)


def _env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("valueFrom", e.get("value")) for e in c.get("env", [])}


def _orchestrator_policy(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (p,) = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy"
        and d["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "orchestrator"
    ]
    return p["spec"]


def test_api_keys_off_by_default_and_fair_cap_on() -> None:
    docs = rendered("defaults")
    c = container(one(docs, "Deployment", "-orchestrator"))
    assert "SPECMASK_API_KEYS" not in _env(c)
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-api-keys")]
    assert flags(c)["max-inflight-per-client"] == "-1"  # auto: bounded by default
    assert not [a for a in c["args"] if a.startswith("--cors-origin")]


def test_api_key_secret_created_and_passed() -> None:
    docs = render({"orchestrator": {"apiKeys": {"enabled": True, "keys": ["sk-one", "sk-two"]}}})
    secret = one(docs, "Secret", "-orchestrator-api-keys")
    text = base64.b64decode(secret["data"]["api-keys"]).decode()
    # What the orchestrator reads from SPECMASK_API_KEYS: each key one client.
    assert load_api_keys(environ={"SPECMASK_API_KEYS": text}) == ("sk-one", "sk-two")
    ref = _env(container(one(docs, "Deployment", "-orchestrator")))["SPECMASK_API_KEYS"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-keys"}


def test_api_key_existing_secret() -> None:
    docs = render({"orchestrator": {"apiKeys": {"enabled": True, "existingSecret": "tenants", "secretKey": "k"}}})
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-api-keys")]
    ref = _env(container(one(docs, "Deployment", "-orchestrator")))["SPECMASK_API_KEYS"]["secretKeyRef"]
    assert ref == {"name": "tenants", "key": "k"}


def test_api_keys_enabled_without_keys_refused() -> None:
    with pytest.raises(helm.HelmError, match=r"apiKeys\.keys or orchestrator\.apiKeys\.existingSecret"):
        render({"orchestrator": {"apiKeys": {"enabled": True}}})


@pytest.mark.parametrize("bad", [{"keys": ["two keys"]}, {"keys": [""]}, {"secretKey": ""}, {"token": "x"}])
def test_api_key_values_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render({"orchestrator": {"apiKeys": {"enabled": True, **bad}}})


def test_orchestrator_network_policy_default_and_configured() -> None:
    spec = _orchestrator_policy(rendered("defaults"))
    api_rule = next(r for r in spec["ingress"] if {"port": ORCH_PORT, "protocol": "TCP"} in r["ports"])
    assert {"port": ORCH_HTTP_PORT, "protocol": "TCP"} in api_rule["ports"]
    assert api_rule["from"] == [{"podSelector": {}}]  # the release's namespace only
    metrics_rule = next(r for r in spec["ingress"] if r["ports"] == [{"port": ORCH_METRICS_PORT, "protocol": "TCP"}])
    assert "from" not in metrics_rule
    peers = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}},
        {"podSelector": {"matchLabels": {"app": "chat-ui"}}},
    ]
    spec = _orchestrator_policy(render({"networkPolicy": {"orchestratorFrom": peers}}))
    api_rule = next(r for r in spec["ingress"] if {"port": ORCH_PORT, "protocol": "TCP"} in r["ports"])
    assert api_rule["from"] == peers
    spec = _orchestrator_policy(render({"orchestrator": {"http": {"enabled": False}}}))
    api_rule = next(r for r in spec["ingress"] if {"port": ORCH_PORT, "protocol": "TCP"} in r["ports"])
    assert api_rule["ports"] == [{"port": ORCH_PORT, "protocol": "TCP"}]


def test_cors_and_cap_reach_the_real_cli() -> None:
    cli = pytest.importorskip("specmask.orchestrator.cli")
    docs = render(
        {
            "orchestrator": {
                "cors": {"allowedOrigins": ["https://a.example", "https://b.example"]},
                "maxInflightPerClient": 12,
            }
        }
    )
    args = container(one(docs, "Deployment", "-orchestrator"))["args"]
    argv = ["orchestrator", *args]
    parsed = cli.build_parser(argv).parse_args(argv)
    assert parsed.cors_origin == ["https://a.example", "https://b.example"]
    assert parsed.max_inflight_per_client == 12
