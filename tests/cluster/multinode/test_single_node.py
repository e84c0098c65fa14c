"""The same application on the same four-node cluster with every part on the head (placement by the frontend
resource): the rounds' split measured as across nodes (test_serving.py `measure_rounds`), so the two layouts
compare on one machine at one time; the round channels go over Unix sockets here, the outputs stay the same."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from cluster.client import SpecServeClient, collect
from tests.cluster.multinode.conftest import PROMPTS
from tests.cluster.multinode.netns_cluster import NetnsCluster
from tests.cluster.multinode.test_serving import (
    cluster_config,
    describe_split,
    measure_rounds,
    serving,
)

pytestmark = pytest.mark.timeout(600)
ON_HEAD = {"resources": {"specserve-frontend": 1}}


@pytest.fixture(scope="module")
def single(netns_cluster: NetnsCluster) -> Iterator[SpecServeClient]:
    fields = {**cluster_config(), "placement": dict.fromkeys(
        ("ingress", "scheduler", "verifier", "drafter", "kv_manager"), ON_HEAD)}
    with serving(netns_cluster, fields, "up-single", timeout_s=120) as client:
        yield client


def test_single_node_layout_rounds(netns_cluster: NetnsCluster, single: SpecServeClient) -> None:
    for part in ("Verifier", "Drafter", "KVManager"):
        assert any(part in title for title in netns_cluster.head.processes()), part
    split = measure_rounds(single)
    print(f"\none node, per round (ms): {describe_split(split)}")
    logs = netns_cluster.log_text(f"{netns_cluster.head.spec.name}/**/*")
    assert len(re.findall(r"channel connected: unix", logs)) >= 3  # verifier, drafter, KV: same node
    (sample,) = collect(single.generate(PROMPTS[0], max_tokens=8, k=4, draft="model")).values()
    assert sample["accepted"] == sample["proposed"] > 0
