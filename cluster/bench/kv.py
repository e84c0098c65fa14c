"""`specserve bench kv`: the KV-block manager's benchmark, printed, not asserted.

    scripts/in-netns.sh .venv/bin/specserve bench kv      # the actor part starts Ray on loopback
    scripts/in-netns.sh .venv/bin/python -m cluster.bench.kv

- ledger: reserve + commit rounds for a batch of requests (k+1 target slots each, random acceptance),
  in request-rounds per second; the goal is well above 20,000 so the ledger is never the bottleneck;
  plus the cost of one `audit()` of the final state.
- actor: the round trip of one batch `reserve` + one batch `commit` call (the two RPCs of a round),
  and of an empty call (`can_admit` of nothing), through the client the engine uses in the cluster
  (`RemoteKV`, cluster/serving/remote_backends.py) over a `KVManagerActor` on this machine.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import TYPE_CHECKING, Any

from kv_manager.ledger import BlockLedger
from kv_manager.request_blocks import cdiv
from kv_manager.schema import AdmitItem, CommitItem, NamespaceConfig, ReserveItem

if TYPE_CHECKING:  # imported when run: it imports ray, which the ledger part does without
    from cluster.serving.remote_backends import RemoteKV

NAMESPACE = "verifier/target"
VOCAB = 32_000


def _setup(batch_size: int, rounds: int, k: int, block_size: int, prompt_len: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    max_len = prompt_len + rounds * (k + 1)
    config = NamespaceConfig(NAMESPACE, num_blocks=batch_size * cdiv(max_len, block_size), block_size=block_size)
    return {
        "config": config,
        "request_ids": [f"req-{index}" for index in range(batch_size)],
        "prompts": [[rng.randrange(VOCAB) for _ in range(prompt_len)] for _ in range(batch_size)],
        "accepted": [[rng.randint(1, k + 1) for _ in range(batch_size)] for _ in range(rounds)],
        "tokens": [rng.randrange(VOCAB) for _ in range(k + 1)],
    }


def bench_ledger(
    batch_size: int = 64, rounds: int = 1000, k: int = 4, block_size: int = 16, prompt_len: int = 128, seed: int = 0
) -> dict[str, Any]:
    case = _setup(batch_size, rounds, k, block_size, prompt_len, seed)
    ledger = BlockLedger([case["config"]])
    holder = ledger.register_worker("bench")
    request_ids, tokens = case["request_ids"], case["tokens"]
    for request_id, prompt in zip(request_ids, case["prompts"], strict=True):
        ledger.add_request(NAMESPACE, request_id, prompt, holder)
        ledger.reserve_one(ReserveItem(NAMESPACE, request_id, len(prompt), holder))
        ledger.commit_one(CommitItem(NAMESPACE, request_id, len(prompt), prompt, holder))
    reserve_items = [ReserveItem(NAMESPACE, request_id, k + 1, holder) for request_id in request_ids]
    start = time.perf_counter()
    for accepted in case["accepted"]:
        ledger.reserve(reserve_items)
        ledger.commit(
            [
                CommitItem(NAMESPACE, request_id, accepted_len, tokens[:accepted_len], holder)
                for request_id, accepted_len in zip(request_ids, accepted, strict=True)
            ]
        )
    elapsed = time.perf_counter() - start
    audit_start = time.perf_counter()
    ledger.assert_no_leaks()
    audit_s = time.perf_counter() - audit_start
    for request_id in request_ids:
        ledger.release(NAMESPACE, request_id)
    ledger.assert_no_leaks()
    return {
        "batch_size": batch_size,
        "rounds": rounds,
        "k": k,
        "block_size": block_size,
        "request_rounds_per_s": batch_size * rounds / elapsed,
        "batch_round_us": elapsed / rounds * 1e6,
        "audit_ms": audit_s * 1e3,
        "audit_blocks": case["config"].num_blocks,
    }


def bench_actor(batch_size: int = 64, rounds: int = 200, k: int = 4, block_size: int = 16, seed: int = 0) -> dict[str, Any]:
    """Needs Ray: uses the running one, or starts a loopback-only one (run under scripts/in-netns.sh)."""
    import ray

    from cluster.serving.remote_backends import RemoteKV
    from kv_manager.actor import KVManagerActor

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    case = _setup(batch_size, rounds, k, block_size, 16, seed)
    actor = KVManagerActor.options(name=None).remote([case["config"]])  # as build_cluster_engine makes it
    try:
        return _actor_rounds(RemoteKV(actor), case, k)
    finally:
        ray.kill(actor, no_restart=True)
        if started_ray:
            ray.shutdown()


def _actor_rounds(kv: RemoteKV, case: dict[str, Any], k: int) -> dict[str, Any]:
    holder = kv.register_worker("bench")
    request_ids, tokens = case["request_ids"], case["tokens"]
    kv.admit(
        [AdmitItem(NAMESPACE, rid, prompt, holder) for rid, prompt in zip(request_ids, case["prompts"], strict=True)]
    )
    reserve_items = [ReserveItem(NAMESPACE, request_id, k + 1, holder) for request_id in request_ids]
    round_s: list[float] = []
    for accepted in case["accepted"]:
        start = time.perf_counter()
        kv.reserve(reserve_items)
        kv.commit(
            [
                CommitItem(NAMESPACE, request_id, accepted_len, tokens[:accepted_len], holder)
                for request_id, accepted_len in zip(request_ids, accepted, strict=True)
            ]
        )
        round_s.append(time.perf_counter() - start)
    empty_s: list[float] = []
    for _ in range(100):
        start = time.perf_counter()
        kv.can_admit([], 0)  # one actor call on an empty plan (free_fraction would answer from its cache)
        empty_s.append(time.perf_counter() - start)
    kv.audit().assert_no_leaks()
    for request_id in request_ids:
        kv.release(request_id, [NAMESPACE])
    report = kv.audit()
    report.assert_no_leaks()
    assert report.counts[NAMESPACE].free == report.counts[NAMESPACE].capacity, report.counts
    batch_size = len(request_ids)
    return {
        "batch_size": batch_size,
        "rounds": len(round_s),
        "round_trip_ms_p50": statistics.median(round_s) * 1e3,
        "round_trip_ms_mean": statistics.fmean(round_s) * 1e3,
        "request_rounds_per_s": batch_size / statistics.fmean(round_s),
        "empty_call_ms_p50": statistics.median(empty_s) * 1e3,
    }


def run_bench(
    *, batch_size: int = 64, ledger_rounds: int = 1000, actor_rounds: int = 200, with_actor: bool = True
) -> dict[str, Any]:
    """Run both parts, print a table, return JSON-able figures."""
    figures: dict[str, Any] = {"ledger": bench_ledger(batch_size=batch_size, rounds=ledger_rounds)}
    if with_actor:
        figures["actor"] = bench_actor(batch_size=batch_size, rounds=actor_rounds)
    ledger = figures["ledger"]
    print(f"kv_manager bench: batch {batch_size}, k {ledger['k']} (k+1 slots/request/round), block {ledger['block_size']}")
    print(f"  ledger reserve+commit  {ledger['request_rounds_per_s']:>12,.0f} request-rounds/s"
          f"  ({ledger['batch_round_us']:,.0f} us per batch round; goal >> 20,000)")
    print(f"  ledger audit()         {ledger['audit_ms']:>12.2f} ms  ({ledger['audit_blocks']:,} blocks, {batch_size} requests)")
    if with_actor:
        actor = figures["actor"]
        print(f"  actor  reserve+commit  {actor['round_trip_ms_p50']:>12.2f} ms p50 round trip"
              f"  (mean {actor['round_trip_ms_mean']:.2f} ms, {actor['request_rounds_per_s']:,.0f} request-rounds/s)")
        print(f"  actor  empty call      {actor['empty_call_ms_p50']:>12.2f} ms p50 round trip")
    return figures


if __name__ == "__main__":
    print(json.dumps(run_bench(), indent=2))
