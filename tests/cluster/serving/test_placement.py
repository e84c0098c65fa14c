"""Placement by configuration (ClusterConfig.placement): each part's Ray node labels / custom resources reach the
deployments' options, a TP verifier's bundles and the KV-manager actor's options (no Ray started)."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.serving.config import ConfigError, NodeSelector, load_config
from tests.cluster.serving.test_app_graph import graph

ROLE = "specserve.io/role"
PLACED = {
    "ingress": {"resources": {"specserve-frontend": 1}},
    "scheduler": {"resources": {"specserve-frontend": 1}, "labels": {ROLE: "frontend"}},
    "kv_manager": {"labels": {ROLE: "kv"}},
    "drafter": {"labels": {ROLE: "drafter"}},
    "verifier": {"resources": {"specserve-verifier": 1}, "labels": {ROLE: "verifier"}},
}


def test_each_deployment_asks_for_its_nodes() -> None:
    deployments = graph(load_config(model="smollm2-135m", draft="smollm2-135m", placement=PLACED))
    options = {name: d.ray_actor_options for name, d in deployments.items()}
    assert options["Ingress"]["resources"] == {"specserve-frontend": 1} and "label_selector" not in options["Ingress"]
    assert options["Scheduler"]["resources"] == {"specserve-frontend": 1}
    assert options["Scheduler"]["label_selector"] == {ROLE: "frontend"}
    assert options["Drafter"]["label_selector"] == {ROLE: "drafter"} and "resources" not in options["Drafter"]
    assert options["Verifier"]["label_selector"] == {ROLE: "verifier"}
    assert options["Verifier"]["resources"] == {"specserve-verifier": 1}
    assert options["Verifier"]["num_cpus"] == 0  # the sizes stay the config's
    # Serve's replica config accepts them (what the controller schedules by)
    assert deployments["Verifier"]._replica_config.resource_dict["specserve-verifier"] == 1


def test_unplaced_parts_ask_for_nothing_more() -> None:
    for deployment in graph(load_config(model="smollm2-135m", draft="smollm2-135m")).values():
        assert not deployment.ray_actor_options.get("resources")
        assert "label_selector" not in deployment.ray_actor_options


def test_each_tp_rank_has_its_own_bundle_placement() -> None:
    placement = {"verifier": {"resources": {"specserve-frontend": 1}, "labels": {ROLE: "frontend"}},
                 "verifier_ranks": [{"resources": {"rank0": 1}, "labels": {ROLE: "gpu-a"}},
                                    {"resources": {"rank1": 1}, "labels": {ROLE: "gpu-b"}}]}
    verifier = graph(load_config(model="smollm2-135m", draft="ngram", tensor_parallel_size=2,
                                 placement=placement))["Verifier"]
    replica = verifier._replica_config
    assert replica.placement_group_bundles == [{"CPU": 0.1, "specserve-frontend": 1},
                                               {"CPU": 1.0, "rank0": 1}, {"CPU": 1.0, "rank1": 1}]
    assert replica.placement_group_bundle_label_selector == [{ROLE: "frontend"}, {ROLE: "gpu-a"}, {ROLE: "gpu-b"}]
    assert verifier.ray_actor_options["resources"] == {"specserve-frontend": 1}  # fits bundle 0


def test_tp_ranks_default_to_the_verifiers_placement() -> None:
    verifier = graph(load_config(model="smollm2-135m", draft="ngram", tensor_parallel_size=2,
                                 placement={"verifier": {"labels": {ROLE: "verifier"}}}))["Verifier"]
    assert verifier._replica_config.placement_group_bundles == [{"CPU": 0.1}] + [{"CPU": 1.0}] * 2
    assert verifier._replica_config.placement_group_bundle_label_selector == [{ROLE: "verifier"}] * 3


def test_kv_manager_actor_options() -> None:
    config = load_config(model="smollm2-135m", draft="ngram", placement=PLACED)
    assert config.placement.kv_manager.actor_options() == {"label_selector": {ROLE: "kv"}}
    assert NodeSelector().actor_options() == {}


def test_the_kv_actor_is_created_with_its_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    """build_cluster_engine passes placement.kv_manager to the actor's options (the actor itself not started)."""
    import kv_manager.actor as actor_module
    from cluster.serving import remote_backends

    seen: dict[str, Any] = {}

    class FakeActorClass:
        def options(self, **options: Any) -> FakeActorClass:
            seen.update(options)
            return self

        def remote(self, namespaces: Any) -> None:
            raise RuntimeError("stop here")

    monkeypatch.setattr(actor_module, "KVManagerActor", FakeActorClass())
    config = load_config(model="smollm2-135m", draft="ngram", placement=PLACED, warm_up=False)
    with pytest.raises(RuntimeError, match="stop here"):
        remote_backends.build_cluster_engine(config, drafter=None, verifier=object())
    assert seen["label_selector"] == {ROLE: "kv"} and seen["name"] is None


@pytest.mark.parametrize(("placement", "problem"), [
    ({"verifier": {"resources": {"CPU": 1}}}, "Ray's own resources"),
    ({"drafter": {"resources": {"specserve-drafter": 0}}}, "must be > 0"),
    ({"verifier_ranks": [{"labels": {ROLE: "a"}}]}, "verifier_ranks names 1 ranks"),
    ({"verifer": {}}, "verifer"),
    ({"verifier": {"label": {ROLE: "a"}}}, "label"),
])
def test_bad_placements_are_refused(placement: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_config(model="smollm2-135m", draft="ngram", tensor_parallel_size=2, placement=placement)
