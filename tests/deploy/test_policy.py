"""The policy check (tests/deploy/policy.py) over every rendered overlay, and over broken copies it must refuse."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.deploy.policy import pod_templates, violations
from tests.deploy.rendering import OVERLAYS, one, rendered


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_pass_the_policy(overlay: str) -> None:
    docs = rendered(overlay)
    assert len(pod_templates(docs)) == 2  # the head and the worker: the check saw the pods inside the RayService
    assert violations(docs) == []


def _worker_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]


def _head_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]


def _init(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _worker_pod(docs)["initContainers"][0]


def _worker(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _worker_pod(docs)["containers"][0]


@pytest.mark.parametrize(("mutate", "expected"), [
    pytest.param(lambda d: _worker(d)["resources"].pop("limits"), "workers/ray-worker: no cpu limit", id="no-limits"),
    pytest.param(lambda d: _init(d).pop("resources"), "workers/prepare-models: no memory limit",
                 id="init-without-resources"),
    pytest.param(lambda d: _init(d)["resources"]["requests"].update(cpu="500m"),
                 "prepare-models: cpu request 500m != limit", id="burstable-init"),
    pytest.param(lambda d: _head_pod(d)["securityContext"].pop("runAsNonRoot"), "ray-head: runAsNonRoot not set",
                 id="may-run-as-root"),
    pytest.param(lambda d: _worker(d)["securityContext"].update(runAsUser=0), "ray-worker: runs as uid 0",
                 id="uid-0"),
    pytest.param(lambda d: _init(d)["securityContext"].update(allowPrivilegeEscalation=True),
                 "prepare-models: allowPrivilegeEscalation is not false", id="privilege-escalation"),
    pytest.param(lambda d: _worker(d)["securityContext"].update(privileged=True), "ray-worker: privileged",
                 id="privileged"),
    pytest.param(lambda d: _worker(d)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
                 "adds capabilities ['SYS_ADMIN']", id="capability-added"),
    pytest.param(lambda d: _head_pod(d).pop("seccompProfile", None) or _head_pod(d)["securityContext"].pop(
        "seccompProfile"), "ray-head: no seccomp profile", id="no-seccomp"),
    pytest.param(lambda d: _worker_pod(d).update(hostNetwork=True), "specserve/workers: hostNetwork",
                 id="host-network"),
    pytest.param(lambda d: _worker_pod(d)["volumes"].append({"name": "host", "hostPath": {"path": "/"}}),
                 "hostPath volume host", id="host-path"),
    pytest.param(lambda d: _head_pod(d).pop("automountServiceAccountToken"), "mounts a service account token",
                 id="service-account-token"),
    pytest.param(lambda d: _worker(d).update(image="specserve:latest"), "image 'specserve:latest' has no pinned tag",
                 id="latest-tag"),
    pytest.param(lambda d: _init(d).pop("imagePullPolicy"), "prepare-models: no imagePullPolicy", id="no-pull-policy"),
])
def test_broken_copies_violate_the_policy(mutate: Callable[[list[dict[str, Any]]], Any], expected: str) -> None:
    docs = rendered("gpu")
    mutate(docs)
    problems = violations(docs)
    assert any(expected in problem for problem in problems), problems


def _policy(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "NetworkPolicy")


def _no_auth_options(docs: list[dict[str, Any]]) -> None:
    one(docs, "RayService")["spec"]["rayClusterConfig"].pop("authOptions")


def _env_auth(docs: list[dict[str, Any]], skip: str = "") -> None:
    """authOptions replaced by RAY_AUTH_MODE/RAY_AUTH_TOKEN env (older KubeRay) on every Ray container but `skip`."""
    _no_auth_options(docs)
    for container in (_head_pod(docs)["containers"][0], _worker(docs)):
        if container["name"] != skip:
            container.setdefault("env", []).extend([
                {"name": "RAY_AUTH_MODE", "value": "token"},
                {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "auth_token"}}}])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_enables_ray_token_auth_and_carries_the_network_policy(overlay: str) -> None:
    docs = rendered(overlay)
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "specserve-ray-auth"}
    policy = _policy(docs)
    assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/instance": "specserve"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    open_rule = policy["spec"]["ingress"][0]
    assert "from" not in open_rule and {p["port"] for p in open_rule["ports"]} == {8000, 9000}
    namespaces = [rule["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"]
                  for rule in policy["spec"]["ingress"][2:]]
    assert namespaces == [["monitoring"], ["kuberay-operator"]]  # params.env monitoringNamespace, kuberayNamespace


def test_ray_auth_by_environment_passes_only_on_every_container() -> None:
    docs = rendered("cpu-dev")
    _env_auth(docs)
    assert violations(docs) == []
    docs = rendered("cpu-dev")
    _env_auth(docs, skip="ray-worker")
    assert [p for p in violations(docs) if "Ray token auth" in p] == [
        "specserve/workers/ray-worker: Ray token auth not enabled (authOptions.mode: token, or RAY_AUTH_MODE=token "
        "and RAY_AUTH_TOKEN from a Secret)"]


@pytest.mark.parametrize(("mutate", "expected"), [
    pytest.param(_no_auth_options, "specserve/head/ray-head: Ray token auth not enabled", id="no-ray-auth"),
    pytest.param(lambda d: one(d, "RayService")["spec"]["rayClusterConfig"]["authOptions"].update(mode="disabled"),
                 "specserve/workers/ray-worker: Ray token auth not enabled", id="ray-auth-disabled"),
    pytest.param(lambda d: d.remove(_policy(d)), "specserve: no NetworkPolicy selects its pods", id="no-network-policy"),
    pytest.param(lambda d: _policy(d)["spec"]["podSelector"]["matchLabels"].update(app="other"),
                 "no NetworkPolicy selects its pods", id="policy-selects-other-pods"),
    pytest.param(lambda d: _policy(d)["spec"]["ingress"][0]["ports"].append({"protocol": "TCP", "port": 6379}),
                 "rule 0: open to anyone on [8000, 9000, 6379]", id="gcs-open-to-anyone"),
    pytest.param(lambda d: _policy(d)["spec"]["ingress"][0].pop("ports"), "rule 0: open to anyone on every port",
                 id="every-port-open"),
    pytest.param(lambda d: _policy(d)["spec"]["ingress"][1]["from"].append({"namespaceSelector": {}}),
                 "rule 1: open to anyone on every port", id="all-namespaces"),
    pytest.param(lambda d: _policy(d)["spec"]["ingress"][3].pop("ports"),
                 "rule 3: every port, to peers other than the RayService's own pods", id="operator-every-port"),
])
def test_copies_without_ray_auth_or_network_policy_fail(mutate: Callable[[list[dict[str, Any]]], Any],
                                                        expected: str) -> None:
    for overlay in OVERLAYS:
        docs = rendered(overlay)
        mutate(docs)
        problems = violations(docs)
        assert any(expected in problem for problem in problems), (overlay, problems)
