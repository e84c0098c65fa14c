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
