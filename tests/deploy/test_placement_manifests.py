"""The overlays' placement (ClusterConfig.placement in serveConfigV2's args) holds once KubeRay and Serve apply
them: the deployments, as the Serve controller builds and overrides them, ask for exactly the custom resources
the placement names (an override replaces the ray_actor_options build_app sets, so the two must agree), a TP
verifier's bundles carry its ranks', and the worker group advertises enough of each while the head advertises
none (docs/multinode.md). Offline, like test_manifests.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cluster.serving.config import RESERVED_RESOURCES, ClusterConfig, NodeSelector
from tests.deploy.rendering import OVERLAYS, one, rendered
from tests.deploy.test_manifests import app_of, built_deployments

PARTS = {"Ingress": "ingress", "Scheduler": "scheduler", "Drafter": "drafter", "Verifier": "verifier"}


@pytest.fixture(scope="module")
def offline() -> Iterator[None]:
    import ray._private.auto_init_hook as hook

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hook, "enable_auto_connect", False)
        yield


def custom(resources: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in resources.items() if k not in RESERVED_RESOURCES and not k.startswith("node:")}


def placement_problems(rayservice: dict[str, Any], deployments: dict[str, Any]) -> list[str]:
    from deploy.serve_app import cluster_config

    config: ClusterConfig = cluster_config(app_of(rayservice)["args"])
    placement = config.placement
    problems = []
    for name, info in deployments.items():
        selector: NodeSelector = getattr(placement, PARTS[name])
        replica = info.replica_config
        asked = custom(replica.resource_dict)
        if asked != custom(selector.resources):
            problems.append(f"{name} asks for {asked}, placement.{PARTS[name]} names {dict(selector.resources)}")
        bundles = replica.placement_group_bundles
        if bundles:
            wanted = [selector] + [placement.rank(r) for r in range(len(bundles) - 1)]
            for index, (bundle, want) in enumerate(zip(bundles, wanted, strict=True)):
                if custom(bundle) != custom(want.resources):
                    problems.append(f"{name} bundle {index} holds {custom(bundle)}, not {dict(want.resources)}")
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    if head.get("resources") or "resources" in head.get("rayStartParams", {}):
        problems.append("the head advertises custom resources")
    advertised: dict[str, float] = {}
    for group in cluster["workerGroupSpecs"]:
        for key, value in group.get("resources", {}).items():
            advertised[key] = advertised.get(key, 0.0) + float(value) * group["replicas"]
    selectors = [placement.ingress, placement.scheduler, placement.kv_manager, placement.verifier,
                 *placement.verifier_ranks]
    if config.uses_draft_model:
        selectors.append(placement.drafter)
    for selector in selectors:
        for key, amount in selector.resources.items():
            if advertised.get(key, 0.0) < amount:
                problems.append(f"{key}: asked {amount}, the worker groups advertise {advertised.get(key, 0.0)}")
        if selector.labels:
            problems.append(f"labels {dict(selector.labels)}: no worker group sets Ray labels here")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_placement_is_what_the_deployments_ask(overlay: str, offline: None) -> None:
    rayservice = one(rendered(overlay), "RayService")
    assert placement_problems(rayservice, built_deployments(app_of(rayservice))) == []


def test_every_overlay_places_every_part() -> None:
    from deploy.serve_app import cluster_config

    for overlay in OVERLAYS:
        placement = cluster_config(app_of(one(rendered(overlay), "RayService"))["args"]).placement
        for part in ("ingress", "scheduler", "kv_manager", "drafter", "verifier"):
            assert getattr(placement, part).resources, (overlay, part)


def _drop_verifier_resource(rayservice: dict[str, Any], deployments: dict[str, Any]) -> None:
    deployments["Verifier"].replica_config.resource_dict.pop("specserve-verifier")


def _unadvertised(rayservice: dict[str, Any], deployments: dict[str, Any]) -> None:
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["resources"].pop("specserve-kv")


def _rank_bundle(rayservice: dict[str, Any], deployments: dict[str, Any]) -> None:
    deployments["Verifier"].replica_config.placement_group_bundles[2].pop("specserve-verifier")


@pytest.mark.parametrize(("mutate", "problem"), [
    pytest.param(_drop_verifier_resource, "Verifier asks for {}", id="override-drops-the-placement"),
    pytest.param(_unadvertised, "specserve-kv: asked 1.0", id="kv-resource-not-advertised"),
    pytest.param(_rank_bundle, "Verifier bundle 2", id="rank-bundle-without-its-resource"),
])
def test_broken_placements_are_found(offline: None, mutate: Any, problem: str) -> None:
    rayservice = one(rendered("gpu"), "RayService")
    deployments = built_deployments(app_of(rayservice))
    mutate(rayservice, deployments)
    problems = placement_problems(rayservice, deployments)
    assert any(problem in p for p in problems), problems
