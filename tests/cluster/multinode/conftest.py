"""One multi-node Ray cluster for the package: four nodes, each in a network namespace of its own (netns_cluster.py).

    head      10.77.0.11  GCS, Serve's controller, the ingress and the scheduler (role frontend)
    verifier  10.77.0.12  the verifier (role verifier)
    drafter   10.77.0.13  the drafter (role drafter)
    kv        10.77.0.14  the KV manager (role kv)

Each node advertises its role both ways ClusterConfig's placement can ask for it: a Ray node label
(specserve.io/role=ROLE) and a custom resource (specserve-ROLE). Run under scripts/in-netns.sh, opt-in (they take
~2 minutes and three Ray nodes' memory): SPECSERVE_MULTINODE=1 scripts/in-netns.sh .venv/bin/python -m pytest -q
tests/cluster/multinode (SPECSERVE_MULTINODE_LOGS=DIR keeps the nodes' logs). Where the machine refuses nested namespaces (or SPECSERVE_MULTINODE_LOOPBACK=1) the nodes are raylets on loopback
instead, said in the log, and the checks that need an address per node skip, saying why.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specserve_types.api import GenerationRequest, SamplingParams, SpecParams
from tests.cluster.multinode.netns_cluster import NetnsCluster, NodeSpec, refusal

ROLE_LABEL = "specserve.io/role"
ROLES = {"head": "frontend", "verifier": "verifier", "drafter": "drafter", "kv": "kv"}
OPT_IN = "SPECSERVE_MULTINODE"
LOOPBACK = "SPECSERVE_MULTINODE_LOOPBACK"  # 1: the loopback fallback even where namespaces can be built
KEEP_LOGS = "SPECSERVE_MULTINODE_LOGS"  # a folder: every node's logs copied there after the run


MAX_CONTEXT = 256
MAX_TOKENS = 20
PROMPTS = ["def fibonacci(n):", "The capital of France is"]


def node_specs() -> list[NodeSpec]:
    return [NodeSpec(name, num_cpus=1, resources={f"specserve-{role}": 100}, labels={ROLE_LABEL: role})
            for name, role in ROLES.items()]


def needs_own_addresses(cluster: NetnsCluster) -> None:
    if not cluster.isolated:
        pytest.skip("loopback fallback: every node has 127.0.0.1, no link of its own")


@pytest.fixture(scope="package")
def netns_cluster() -> Iterator[NetnsCluster]:
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"multi-node tests are opt-in: {OPT_IN}=1 scripts/in-netns.sh .venv/bin/python -m pytest -q "
                    "tests/cluster/multinode")
    why = "forced by " + LOOPBACK if os.environ.get(LOOPBACK) == "1" else refusal()
    if why is not None:  # the fallback: several raylets on loopback, said in the log and in the skips it causes
        warnings.warn(f"multi-node tests on loopback raylets, no namespace per node ({why})", stacklevel=1)
        print(f"\nmultinode: no network namespace per node ({why}); {len(ROLES)} raylets on loopback instead")
    # short paths: Ray's Unix sockets live under each node's temp folder (108-byte limit)
    base = Path(os.environ.get("RAY_TMPDIR") or "/tmp")
    root = Path(os.path.realpath(base)) / f"mn{os.getpid()}"
    cluster = NetnsCluster(root, node_specs(), isolated=why is None)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if keep := os.environ.get(KEEP_LOGS):  # the nodes' Ray logs and the drivers' output, for a failed run
            shutil.copytree(root, Path(keep) / root.name, ignore=shutil.ignore_patterns("sockets", "*.sock"),
                            ignore_dangling_symlinks=True, dirs_exist_ok=True)


@pytest.fixture(scope="package")
def reference() -> dict[str, dict[str, Any]]:
    """The in-process engine's greedy outputs, one request at a time."""
    import torch

    from tests.cluster.engine.engine_helpers import local_engine

    torch.set_num_threads(1)
    engine = local_engine("smollm2-135m", "ngram", max_batch=1, max_context=MAX_CONTEXT, dtype="bfloat16")
    out = {}
    for prompt in PROMPTS:
        ids = tuple(engine.tokenizer(prompt)["input_ids"])
        rid = f"ref-{len(out)}"
        engine.submit(GenerationRequest(rid, ids, SamplingParams(max_tokens=MAX_TOKENS),
                                        SpecParams(contract="greedy", k=4, draft="ngram")))
        chunks = engine.run_to_completion()[rid]
        out[prompt] = {"token_ids": [t for c in chunks for t in c.token_ids],
                       "text": "".join(c.text_delta for c in chunks)}
    return out
