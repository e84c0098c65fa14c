"""The Qwen pair across nodes: Qwen2.5-Coder-1.5B verifying on a node of its own, its 0.5B sibling drafting on
another, the KV manager on a third, the scheduler and the doors on the head; greedy outputs through gRPC and HTTP
equal the in-process engine's with the same weights and dtypes (q4 both), and the scheduler reaches every worker over
TCP to its node's address. Skipped, and said so, where the pair is not prepared (`specserve models prepare NAME`:
`make setup` prepares SmolLM2 only)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from cluster.client import SpecServeClient, collect
from specserve_types.api import GenerationRequest, SamplingParams, SpecParams
from tests.cluster.multinode.conftest import MAX_CONTEXT, MAX_TOKENS, PROMPTS
from tests.cluster.multinode.netns_cluster import NetnsCluster
from tests.cluster.multinode.test_serving import HTTP_PORT, cluster_config, serving

pytestmark = pytest.mark.timeout(900)

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def qwen_reference() -> dict[str, list[int]]:
    """The in-process engine's greedy token ids, one request at a time, with the deployment's dtypes."""
    import torch

    from tests.cluster.engine.engine_helpers import local_engine, prepared_model

    prepared_model(TARGET)
    prepared_model(DRAFT)
    torch.set_num_threads(1)
    engine = local_engine(TARGET, DRAFT, max_batch=1, max_context=MAX_CONTEXT, dtype="q4", draft_dtype="q4")
    out = {}
    for index, prompt in enumerate(PROMPTS):
        ids = tuple(engine.tokenizer(prompt)["input_ids"])
        engine.submit(GenerationRequest(f"ref-{index}", ids, SamplingParams(max_tokens=MAX_TOKENS),
                                        SpecParams(contract="greedy", k=4, draft="model")))
        out[prompt] = [t for c in engine.run_to_completion()[f"ref-{index}"] for t in c.token_ids]
    engine.kv.audit().assert_no_leaks()
    return out


@pytest.fixture(scope="module")
def qwen_cluster(netns_cluster: NetnsCluster, qwen_reference: dict[str, list[int]]) -> Iterator[SpecServeClient]:
    fields = {**cluster_config(), "model": TARGET, "draft": DRAFT, "dtype": "q4", "draft_dtype": "q4"}
    with serving(netns_cluster, fields, "up-qwen", timeout_s=300) as client:
        yield client


def test_qwen_pair_across_nodes(netns_cluster: NetnsCluster, qwen_cluster: SpecServeClient,
                                qwen_reference: dict[str, list[int]]) -> None:
    for node, part in (("verifier", "Verifier"), ("drafter", "Drafter"), ("kv", "KVManager")):
        assert any(part in title for title in netns_cluster.node(node).processes()), (node, part)
    drafted = 0
    for prompt in PROMPTS:
        for draft in ("model", "none"):
            (sample,) = collect(qwen_cluster.generate(prompt, max_tokens=MAX_TOKENS, k=4, contract="greedy",
                                                      draft=draft)).values()
            assert sample["token_ids"] == qwen_reference[prompt], (prompt, draft)
            drafted += sample["proposed"] if draft == "model" else 0
        body: dict[str, Any] = {"model": TARGET, "prompt": prompt, "max_tokens": MAX_TOKENS, "k": 4, "draft": "model"}
        answer = requests.post(f"http://{netns_cluster.head.address}:{HTTP_PORT}/v1/completions", json=body,
                               timeout=300).json()
        assert answer["choices"][0]["token_ids"] == qwen_reference[prompt], answer
    assert drafted > 0  # the 0.5B model drafted on its node
    logs = netns_cluster.log_text(f"{netns_cluster.head.spec.name}/**/*")
    connected = set(re.findall(r"channel connected: tcp \S+ -> ([\d.]+):\d+", logs))
    assert {netns_cluster.node(n).address for n in ("verifier", "drafter", "kv")} <= connected, connected
    assert qwen_cluster.stats()["kv"]["leaked_blocks"] == 0
