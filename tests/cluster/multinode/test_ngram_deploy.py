"""SmolLM2 with `draft: ngram` across nodes: no Drafter deployment (n-gram drafts in the scheduler), the verifier
and the KV manager each on a node of its own; greedy outputs through gRPC and HTTP equal the in-process engine's,
and the scheduler's links to both are TCP to their nodes' addresses."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from cluster.client import SpecServeClient, collect
from tests.cluster.multinode.conftest import MAX_TOKENS, PROMPTS
from tests.cluster.multinode.netns_cluster import NetnsCluster
from tests.cluster.multinode.test_serving import HTTP_PORT, cluster_config, serving

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def ngram_cluster(netns_cluster: NetnsCluster) -> Iterator[SpecServeClient]:
    placement = {k: v for k, v in cluster_config()["placement"].items() if k != "drafter"}
    fields = {**cluster_config(), "draft": "ngram", "placement": placement}
    fields.pop("draft_dtype")
    with serving(netns_cluster, fields, "up-ngram", timeout_s=120) as client:
        yield client


def test_ngram_cluster_across_nodes(netns_cluster: NetnsCluster, ngram_cluster: SpecServeClient,
                                    reference: dict[str, dict[str, Any]]) -> None:
    assert not any("Drafter" in title for node in netns_cluster.nodes for title in node.processes())
    assert any("Verifier" in title for title in netns_cluster.node("verifier").processes())
    assert any("KVManager" in title for title in netns_cluster.node("kv").processes())
    for prompt in PROMPTS:
        for draft in ("ngram", "none"):
            (sample,) = collect(ngram_cluster.generate(prompt, max_tokens=MAX_TOKENS, k=4, contract="greedy",
                                                       draft=draft)).values()
            assert sample["token_ids"] == reference[prompt]["token_ids"], (prompt, draft)
        body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": MAX_TOKENS, "k": 4}
        answer = requests.post(f"http://{netns_cluster.head.address}:{HTTP_PORT}/v1/completions", json=body,
                               timeout=120).json()
        assert answer["choices"][0]["token_ids"] == reference[prompt]["token_ids"], answer
    assert ngram_cluster.list_models() == [{"id": "smollm2-135m", "role": "target", "draft": "ngram"}]
    # the latest scheduler's connections: to the verifier's and the KV manager's addresses, over TCP
    logs = netns_cluster.log_text(f"{netns_cluster.head.spec.name}/**/*")
    connected = set(re.findall(r"channel connected: tcp \S+ -> ([\d.]+):\d+", logs))
    assert {netns_cluster.node("verifier").address, netns_cluster.node("kv").address} <= connected
    assert ngram_cluster.stats()["kv"]["leaked_blocks"] == 0
