"""The live cluster the tests of this package share (one deployment for the package), and what they ask it.

SmolLM2-135M is its own draft model (a Drafter deployment), so requests can draft with the model, by
n-gram, or not at all. Run inside the loopback-only namespace (scripts/in-netns.sh).
"""

from __future__ import annotations

import time
from typing import Any

import requests

from cluster.serving.config import ClusterConfig, load_config

GRPC_PORT, HTTP_PORT = 19310, 18310
MAX_CONTEXT = 256
QUEUE_CAPACITY = 100
BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"


def cluster_config(**overrides: object) -> ClusterConfig:
    return load_config(
        model="smollm2-135m", draft="smollm2-135m", worker_threads=1, kv_blocks=512, block_size=16,
        queue_capacity=QUEUE_CAPACITY, max_batch=16, max_context=MAX_CONTEXT, grpc_port=GRPC_PORT,
        http_port=HTTP_PORT, health_check_period_s=1.0, health_check_timeout_s=10.0,
        graceful_shutdown_wait_loop_s=0.2, graceful_shutdown_timeout_s=2.0,
        # one gRPC channel (one client, the server has no keys) fills the whole queue in test_serve_cluster.py: the
        # per-client shares at the queue's size (test_fair_shares_live.py tests them, with keys)
        max_client_completions=QUEUE_CAPACITY, max_client_tokens=QUEUE_CAPACITY * MAX_CONTEXT,
        # drafting for itself in its own precision: every greedy draft survives (test_serve_cluster.py); pinned,
        # as auto may run q4 (model_runtime/precision.py) on one rank and bfloat16 on the TP=3 verifier
        **{"dtype": "bfloat16", "draft_dtype": "bfloat16", **overrides},
    )


def scheduler_call(method: str) -> Any:
    from ray import serve

    return getattr(serve.get_deployment_handle("Scheduler", "specserve"), method).remote().result(timeout_s=60)


def wait_idle(timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = scheduler_call("stats")
        if stats["scheduler"]["live"] == 0 and stats["engine"]["running"] == 0 and stats["engine"]["waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, f"cluster not idle: {stats['scheduler']}"
        time.sleep(0.1)


def assert_no_leaks() -> None:
    """Nothing running, no leaked block, nothing reserved or committed in either namespace."""
    wait_idle()
    report = scheduler_call("audit")
    report.assert_no_leaks()
    for namespace, counts in report.counts.items():
        assert (counts.reserved, counts.committed) == (0, 0), (namespace, counts)


def wait_aborted(count: int, timeout_s: float = 60.0) -> None:
    """The cancel travels client -> ingress -> scheduler asynchronously: wait for it to land."""
    deadline = time.monotonic() + timeout_s
    while (aborted := (stats := scheduler_call("stats")["scheduler"])["aborted"]) < count:
        assert time.monotonic() < deadline, f"{aborted} aborts reached the scheduler, expected {count}: {stats}"
        time.sleep(0.1)


def http(path: str, body: dict | None = None, **kwargs: Any) -> requests.Response:
    url = f"{BASE_URL}{path}"
    if body is None:
        return requests.get(url, timeout=60)
    return requests.post(url, json=body, timeout=120, **kwargs)
