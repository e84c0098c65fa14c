"""The Drafter replica killed (SIGKILL) in the middle of a greedy stream.

SmolLM2-135M drafts for itself (every greedy draft survives), so the stream speculates k=4 until the
kill. After it the engine must fall back to plain decoding for the rest of the stream: the output
stays token for token equal to plain greedy decoding, the fallback is recorded (the request's
`policy_events`, the engine's `fallback_events` in GetStats), the KV ledger ends with nothing
leaked, and once Serve has replaced the replica, a new request speculates again.
Serve's router holds a call to a dead replica until its replacement is up (seconds to minutes), so
the engine only sees the failure through `drafter_timeout_s` (cluster/serving/remote_backends.py HandleDrafter).
Run inside the loopback-only namespace: scripts/in-netns.sh .venv/bin/python -m pytest -q tests/cluster
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.client import SpecServeClient, collect
from cluster.serving.config import ClusterConfig, load_config
from specserve_types.api import GenerationRequest, SamplingParams, SpecParams

pytestmark = pytest.mark.timeout(300)

GRPC_PORT, HTTP_PORT = 19510, 18510
PROMPT = "def fibonacci(n):"
STREAM_TOKENS = 96  # ~20 rounds of k=4: the kill lands early in the stream
AFTER_TOKENS = 24


def cluster_config() -> ClusterConfig:
    return load_config(
        model="smollm2-135m", draft="smollm2-135m", worker_threads=1, kv_blocks=128, block_size=16,
        dtype="bfloat16", draft_dtype="bfloat16",  # drafting for itself in its own precision: every draft survives
        queue_capacity=8, max_batch=4, max_context=256, grpc_port=GRPC_PORT, http_port=HTTP_PORT,
        drafter_retry_seconds=1.0, drafter_timeout_s=1.0, health_check_period_s=1.0, health_check_timeout_s=10.0,
        graceful_shutdown_wait_loop_s=0.2, graceful_shutdown_timeout_s=2.0,
    )


@pytest.fixture(scope="module")
def client(ray_session: Any) -> Iterator[SpecServeClient]:
    from ray import serve

    from cluster.serving.app import deploy

    deploy(cluster_config())
    try:
        with SpecServeClient(f"127.0.0.1:{GRPC_PORT}", timeout_s=120) as c:
            yield c
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def plain_greedy() -> list[int]:
    """Plain greedy decoding in process (no drafts at all): the truth the stream must match."""
    import torch

    from tests.cluster.engine.engine_helpers import local_engine

    torch.set_num_threads(1)
    engine = local_engine("smollm2-135m", "none", max_batch=1, max_context=256, dtype="bfloat16")
    ids = tuple(engine.tokenizer(PROMPT)["input_ids"])
    engine.submit(GenerationRequest("plain", ids, SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True),
                                    SpecParams(contract="greedy", k=0, draft="none")))
    return [t for chunk in engine.run_to_completion()["plain"] for t in chunk.token_ids]


def drafter_pid(timeout_s: float = 120.0) -> int:
    """The live Drafter replica's pid (waits while Serve has no running replica)."""
    from ray import serve

    return serve.get_deployment_handle("Drafter", "specserve").pid.remote().result(timeout_s=timeout_s)


def scheduler_call(method: str) -> Any:
    from ray import serve

    return getattr(serve.get_deployment_handle("Scheduler", "specserve"), method).remote().result(timeout_s=60)


def assert_no_leaks() -> None:
    deadline = time.monotonic() + 60
    while (stats := scheduler_call("stats"))["scheduler"]["live"] or stats["engine"]["running"]:
        assert time.monotonic() < deadline, f"cluster not idle: {stats['scheduler']}"
        time.sleep(0.1)
    report = scheduler_call("audit")
    report.assert_no_leaks()
    for namespace, counts in report.counts.items():
        assert (counts.reserved, counts.committed) == (0, 0), (namespace, counts)


def stream_with_kill(client: SpecServeClient, pid: int) -> tuple[list[Any], int]:
    """Consume a k=4 model-drafted greedy stream; SIGKILL the drafter after its first chunk."""
    items, killed_after = [], -1
    for item in client.generate(PROMPT, max_tokens=STREAM_TOKENS, k=4, contract="greedy", draft="model",
                                ignore_eos=True):
        items.append(item)
        if killed_after < 0:
            os.kill(pid, signal.SIGKILL)
            killed_after = sum(len(i.chunk.token_ids) for i in items)
    return items, killed_after


def test_the_warm_up_timed_the_drafter(client: SpecServeClient) -> None:
    """Before any request: the scheduler's warm-up waited for the drafter's replica and timed its step and every k's
    verify (started while the drafter was loading, it ran plain and measured neither)."""
    cost = client.stats()["engine"]["cost_model"]
    assert cost["draft_token_seconds"] is not None
    assert {"2", "3", "4", "5"} <= set(cost["verify_seconds_by_tokens"])


def test_drafter_killed_mid_stream_falls_back_then_recovers(client: SpecServeClient, plain_greedy: list[int]) -> None:
    pid = drafter_pid()
    (warm,) = collect(client.generate(PROMPT, max_tokens=8, k=4, draft="model", ignore_eos=True)).values()
    assert warm["token_ids"] == plain_greedy[:8] and warm["stats"]["acceptance"]["accepted"] > 0

    items, killed_after = stream_with_kill(client, pid)
    assert 0 < killed_after < STREAM_TOKENS - 8, "the kill did not land mid-stream"
    assert [t for item in items for t in item.chunk.token_ids] == plain_greedy  # output never changes
    final = items[-1].chunk
    assert final.finish_reason == "length" and final.stats["output_tokens"] == STREAM_TOKENS
    reasons = [event["reason"] for event in final.stats["policy_events"]]
    assert any(reason.startswith("fallback: drafter") for reason in reasons), reasons
    acceptance = final.stats["acceptance"]
    assert acceptance["accepted"] > 0  # the drafts before the kill (and after the replacement) survived
    assert final.stats["rounds"] > acceptance["rounds"]  # plain-decoding rounds after the kill
    events = [event["event"] for event in client.stats()["engine"]["fallback_events"]]
    assert "drafter unavailable" in events, events
    assert_no_leaks()

    # Serve replaces the replica; the engine retries it (drafter_retry_seconds) and speculates again
    deadline = time.monotonic() + 120
    new_pid = pid
    while new_pid == pid:
        assert time.monotonic() < deadline, "Serve did not replace the killed Drafter replica"
        time.sleep(0.5)
        try:
            new_pid = drafter_pid()
        except Exception:  # the handle may still route to the dead replica once
            continue
    # the engine's back-off doubles per failed retry (each try while the replica restarts is one), so the first
    # request after the replacement may still decode plainly: within a deadline, one must speculate throughout
    deadline = time.monotonic() + 60
    while True:
        (after,) = collect(client.generate(PROMPT, max_tokens=AFTER_TOKENS, k=4, contract="greedy", draft="model",
                                           ignore_eos=True)).values()
        assert after["finish_reason"] == "length" and after["token_ids"] == plain_greedy[:AFTER_TOKENS]
        reasons = [event["reason"] for event in after["stats"]["policy_events"]]
        if not any(reason.startswith("fallback") for reason in reasons) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert not any(reason.startswith("fallback") for reason in reasons), reasons
    acceptance = after["stats"]["acceptance"]
    assert acceptance["proposed"] > 0 and acceptance["accepted"] == acceptance["proposed"], after["stats"]
    events = [event["event"] for event in client.stats()["engine"]["fallback_events"]]
    assert "drafter retried" in events, events
    assert_no_leaks()
