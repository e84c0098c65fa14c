"""The experiment files themselves (no Ray): every action they name exists with those arguments, the KV scenarios
explain no error finish any more (the ledger is rebuilt: docs/ARCHITECTURE.md §6), and each node-loss scenario's
placement puts the part it loses alone on one extra node, the ingress and the scheduler on the head."""

from __future__ import annotations

import inspect

import pytest

from chaos import actions
from chaos.cluster import HEAD_RESOURCE, chaos_config
from chaos.invariants import judge
from chaos.load import RequestRecord, RequestSpec
from chaos.nodes import NodeSpec
from chaos.runner import cluster_of, load_experiment, scenario_names

NODE_LOSS = {"node-loss-drafter": "drafter", "node-loss-verifier": "verifier", "node-loss-kv": "kv_manager"}


@pytest.mark.parametrize("name", scenario_names())
def test_every_action_exists_with_its_arguments(name: str) -> None:
    experiment = load_experiment(name)
    for activity in experiment["method"] + experiment.get("rollbacks", []):
        provider = activity["provider"]
        assert provider["module"] == "chaos.actions", activity["name"]
        fn = getattr(actions, provider["func"])
        inspect.signature(fn).bind(**provider.get("arguments", {}))  # raises on an unknown or missing argument
    overrides, nodes = cluster_of(experiment)
    chaos_config(**overrides)  # the overrides validate
    assert len({NodeSpec.of(n).name for n in nodes}) == len(nodes)


@pytest.mark.parametrize("name", ["kv-manager-kill", *NODE_LOSS])
def test_no_error_finish_is_explained_where_the_ledger_is_rebuilt(name: str) -> None:
    experiment = load_experiment(name)
    assert experiment["explained_errors"] == []
    spec = RequestSpec("greedy", "hi", 4, "grpc")
    record = RequestRecord("r0", spec.key, "grpc", True, 0.0, 60.0, 4)
    record.outcome, record.finish_reason, record.end = "error_finish", "error", 1.0
    verdict = judge([record], {spec.key: spec}, {spec.key: [1, 2, 3, 4]}, None,
                    frozenset(experiment["explained_errors"]))
    assert verdict.lost == 1 and not verdict.ok  # an error finish fails the scenario


@pytest.mark.parametrize(("name", "part"), NODE_LOSS.items())
def test_a_node_loss_loses_exactly_its_part(name: str, part: str) -> None:
    experiment = load_experiment(name)
    overrides, nodes = cluster_of(experiment)
    placement = chaos_config(**overrides).placement
    specs = {spec.name: spec for spec in map(NodeSpec.of, nodes)}
    [lose] = [a for a in experiment["method"] if a["provider"]["func"] == "lose_node"]
    lost = specs[lose["provider"]["arguments"]["node"]]
    hosts = {name: [s.name for s in specs.values() if set(getattr(placement, name).resources) <= set(s.resources)]
             for name in ("drafter", "verifier", "kv_manager")}
    assert hosts[part] == [lost.name]  # only that node can host it: it comes back on the re-added node
    assert all(len(names) == 1 and (names[0] == lost.name) == (name == part) for name, names in hosts.items())
    assert placement.ingress.resources == placement.scheduler.resources == {HEAD_RESOURCE: 1}
    assert not any(HEAD_RESOURCE in s.resources for s in specs.values())
