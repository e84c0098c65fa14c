"""The KV manager actor through RemoteKV, the client the engine uses in the cluster: typed errors,
200 concurrent requests with random cancellations, restarts (the ledger rebuilt, the rounds go on), a dead actor.

Run under scripts/in-netns.sh (loopback only); Ray starts once per session (`ray_session`).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import pytest
from ray.exceptions import RayActorError

from cluster.serving.remote_backends import RemoteKV
from kv_manager import (
    Admission,
    AdmitItem,
    CommitItem,
    CommitResult,
    DuplicateRequest,
    ExceedsCapacity,
    Holder,
    KVError,
    NamespaceConfig,
    OutOfBlocks,
    Reservation,
    ReserveItem,
    RetriableKVError,
    StaleEpoch,
    UnknownRequest,
)
from kv_manager.actor import KVManagerActor
from tests.kv_manager.kv_helpers import DRAFT, TARGET

NUM_REQUESTS = 200
NUM_CANCELLED = 60
PREFIXES = [[base] * 8 for base in range(5)]  # 5 shared prompt prefixes of 2 blocks
DEADLINE_S = 60.0


def start_actor(namespaces: Sequence[NamespaceConfig]) -> Any:
    return KVManagerActor.options(name=None).remote(list(namespaces))  # as build_cluster_engine does


def end_of_test_check(kv: RemoteKV) -> None:
    """Audit clean, every block free, no request left in any namespace."""
    report = kv.audit()
    report.assert_no_leaks()
    assert all(c.free == c.capacity for c in report.counts.values()), report.counts
    assert {namespace: kv.request_ids(namespace) for namespace in report.counts} == {ns: [] for ns in report.counts}


@pytest.mark.parametrize("transport", ["channel", "ray"])
def test_typed_errors_and_stale_epochs_through_remote_kv(ray_session: ModuleType, transport: str) -> None:
    actor = start_actor([NamespaceConfig(TARGET, num_blocks=4, block_size=4)])
    try:
        kv = RemoteKV(actor, transport=transport)
        holder = kv.register_worker("w0")
        admissions = kv.admit([AdmitItem(TARGET, r, [1, 2, 3], holder) for r in ("a", "b")])
        assert all(isinstance(a, Admission) and a.num_cached_tokens == 0 for a in admissions)
        with pytest.raises(DuplicateRequest) as duplicate:  # all or nothing: "c" is given back
            kv.admit([AdmitItem(TARGET, "c", [1], holder), AdmitItem(TARGET, "a", [1], holder)])
        assert duplicate.value.request_id == "a" and duplicate.value.namespace == TARGET
        assert sorted(kv.request_ids(TARGET)) == ["a", "b"]
        grant, missing = kv.reserve([ReserveItem(TARGET, "a", 5, holder), ReserveItem(TARGET, "x", 1, holder)])
        assert isinstance(grant, Reservation) and grant.slot_mapping == (0, 1, 2, 3, 4)
        assert isinstance(missing, UnknownRequest) and missing.request_id == "x"
        [refusal] = kv.reserve([ReserveItem(TARGET, "b", 12, holder)])  # 3 blocks wanted, 2 free
        assert isinstance(refusal, OutOfBlocks) and (refusal.namespace, refusal.request_id) == (TARGET, "b")
        assert kv.free_fraction(TARGET) == 0.5
        assert kv.can_admit([AdmitItem(TARGET, "c", [0] * 8, holder)], 0)
        assert not kv.can_admit([AdmitItem(TARGET, "c", [0] * 8, holder)], 1)
        with pytest.raises(ExceedsCapacity) as too_big:  # raised in the actor, re-raised typed by the client
            kv.can_admit([AdmitItem(TARGET, "c", [0] * 17, holder)], 0)
        assert too_big.value.namespace == TARGET
        assert kv.expire_worker("w0") == 2
        [late] = kv.commit([CommitItem(TARGET, "a", 1, [1], holder)])
        assert isinstance(late, StaleEpoch)
        assert kv.free_fraction(TARGET) == 1.0
        end_of_test_check(kv)
    finally:
        ray_session.kill(actor, no_restart=True)


def _raise_refusals(outcomes: Sequence[object]) -> None:
    for outcome in outcomes:
        if isinstance(outcome, KVError):
            raise outcome


def _one_request(kv: RemoteKV, index: int, holder: Holder, cancel_at: int | None) -> str:
    """Admit, prefill, run 2-5 speculative rounds (target k+1 slots, draft k), release on every exit.
    A request cancelled at round `cancel_at` (0: the prefill) stops between its reserve and its commit,
    as an abort between the engine's two calls of a round does."""
    rng = random.Random(index)
    request_id = f"req-{index}"
    prompt = [*PREFIXES[index % len(PREFIXES)], *(rng.randrange(50) for _ in range(rng.randint(1, 12)))]
    namespaces = [TARGET, DRAFT]
    try:
        admissions = kv.admit([AdmitItem(ns, request_id, prompt, holder) for ns in namespaces])
        cached = [a.num_cached_tokens for a in admissions]
        rests = list(zip(namespaces, cached, strict=True))
        _raise_refusals(kv.reserve([ReserveItem(ns, request_id, len(prompt) - c, holder) for ns, c in rests]))
        time.sleep(rng.random() * 0.01)  # the prefill forward
        if cancel_at == 0:
            return "cancelled"
        _raise_refusals(kv.commit([CommitItem(ns, request_id, len(prompt) - c, prompt[c:], holder) for ns, c in rests]))
        for round_index in range(1, rng.randint(2, 5) + 1):
            k = rng.randint(1, 4)
            _raise_refusals(kv.reserve([ReserveItem(TARGET, request_id, k + 1, holder),
                                        ReserveItem(DRAFT, request_id, k, holder)]))
            time.sleep(rng.random() * 0.01)  # propose + verify
            if cancel_at == round_index:
                return "cancelled"
            accepted = rng.randint(0, k)
            tokens = [rng.randrange(50) for _ in range(accepted + 1)]
            _raise_refusals(kv.commit([CommitItem(TARGET, request_id, accepted + 1, tokens, holder),
                                       CommitItem(DRAFT, request_id, accepted, tokens[:accepted], holder)]))
        return "finished"
    except OutOfBlocks:
        return "preempted"
    finally:
        kv.release(request_id, namespaces)


def test_200_concurrent_requests_with_random_cancellations_leak_nothing(ray_session: ModuleType) -> None:
    configs = [NamespaceConfig(TARGET, num_blocks=400, block_size=4), NamespaceConfig(DRAFT, 300, 4, prefix_caching=False)]
    actor = start_actor(configs)
    rng = random.Random(7)
    cancel_at = {index: rng.randint(0, 2) for index in rng.sample(range(NUM_REQUESTS), NUM_CANCELLED)}
    try:
        # four workers' clients, one actor; two over round channels, two over Ray calls: both paths at once
        kvs = [RemoteKV(actor, transport="channel" if w % 2 else "ray") for w in range(4)]
        holders = [kv.register_worker(f"worker-{w}") for w, kv in enumerate(kvs)]
        with ThreadPoolExecutor(max_workers=NUM_REQUESTS) as pool:
            futures = [pool.submit(_one_request, kvs[index % 4], index, holders[index % 4], cancel_at.get(index))
                       for index in range(NUM_REQUESTS)]
            unexpected = [f.exception() for f in futures if f.exception() is not None]
        assert not unexpected, unexpected[:3]
        tally = Counter(f.result() for f in futures)
        end_of_test_check(kvs[0])
    finally:
        ray_session.kill(actor, no_restart=True)
    print(f"{NUM_REQUESTS} concurrent requests: {dict(tally)}")
    assert sum(tally.values()) == NUM_REQUESTS
    assert tally["finished"] > 0 and tally["cancelled"] > 0


def _wait_for_incarnation(ray: ModuleType, actor: Any, other_than: str) -> str:
    """Ask the raw handle (not a client, which keeps its incarnation) until a new instance answers."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            incarnation = ray.get(actor.incarnation.remote(), timeout=DEADLINE_S)
        except RayActorError:  # in flight when the old instance died
            continue
        if incarnation != other_than:
            return incarnation
    raise AssertionError(f"the kv manager actor did not restart within {DEADLINE_S}s")


@pytest.mark.parametrize("transport", ["channel", "ray"])
def test_a_restart_rebuilds_the_ledger_and_the_rounds_in_flight_go_on(ray_session: ModuleType, transport: str) -> None:
    """Killed between a round's reserve and its commit: the commit waits for the new instance, which rebuilds the
    ledger from the client's record (the same blocks: the workers' KV stays right), and goes on. Killed again
    before an ahead call (commit + the next window beside a verify): the same."""
    actor = start_actor([NamespaceConfig(TARGET, num_blocks=16, block_size=4)])
    prompt = list(range(10))
    try:
        kv = RemoteKV(actor, transport=transport)
        first = kv.incarnation
        holder = kv.register_worker("w0")
        kv.admit([AdmitItem(TARGET, "r", prompt, holder)])
        kv.reserve([ReserveItem(TARGET, "r", 10, holder)])
        kv.commit([CommitItem(TARGET, "r", 10, prompt, holder)])
        [grant] = kv.reserve([ReserveItem(TARGET, "r", 3, holder)])  # a round in flight: positions 10..12
        [hit] = kv.admit([AdmitItem(TARGET, "s", prompt, holder)])  # shares r's first two blocks
        assert isinstance(grant, Reservation) and hit.block_table == grant.block_table[:2]

        ray_session.kill(actor, no_restart=False)  # a crash: Ray restarts the actor, empty
        second = _wait_for_incarnation(ray_session, actor, first)
        [result] = kv.commit([CommitItem(TARGET, "r", 2, [10, 11], holder)])  # the round's commit goes on
        assert isinstance(result, CommitResult) and result.committed_len == 12
        assert result.block_table == grant.block_table[:3]  # the same blocks; block 3 (position 12) back
        assert kv.incarnation not in (first, second) and len(kv.rebuilds) == 1
        assert sorted(kv.request_ids(TARGET)) == ["r", "s"] and kv.audit().ok
        assert kv.register_worker("w1").epoch > holder.epoch  # a new worker's epoch: above every earlier one

        third = kv.incarnation
        ray_session.kill(actor, no_restart=False)
        _wait_for_incarnation(ray_session, actor, third)
        kv.reserve([ReserveItem(TARGET, "s", 4, holder)])  # rebuilt again here (s's first round)
        ahead = kv.commit_then_reserve_ahead([CommitItem(TARGET, "s", 2, prompt[8:], holder)],
                                             [ReserveItem(TARGET, "r", 5, holder)])
        committed, reserved = ahead.result()
        assert isinstance(committed[0], CommitResult) and isinstance(reserved[0], Reservation)
        assert len(kv.rebuilds) == 2
        kv.commit([CommitItem(TARGET, "r", 0, [], holder, finished=True)])
        kv.release("s", [TARGET])
        end_of_test_check(kv)
    finally:
        ray_session.kill(actor, no_restart=True)


def _wait_until_dead(ray: ModuleType, actor: Any, pid: int) -> None:
    """`ray.kill` only asks: a call sent before the kill reaches the actor still runs and answers.
    Call the raw handle until a call fails (Ray has the actor dead), then wait for its process to end (a round
    channel's call that reached the process before it ended is answered, as a Ray call sent before the kill)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            ray.get(actor.incarnation.remote(), timeout=DEADLINE_S)
        except RayActorError:
            break
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return
        time.sleep(0.01)
    raise AssertionError(f"the killed kv manager actor still answered after {DEADLINE_S}s")


def test_a_dead_actor_gives_a_retriable_error(ray_session: ModuleType) -> None:
    actor = start_actor([NamespaceConfig(TARGET, num_blocks=4, block_size=4)])
    kv = RemoteKV(actor)
    holder = kv.register_worker("w0")
    pid = ray_session.get(actor.pid.remote())
    ray_session.kill(actor, no_restart=True)
    _wait_until_dead(ray_session, actor, pid)
    with pytest.raises(RetriableKVError):
        kv.reserve([ReserveItem(TARGET, "r", 1, holder)])
    with pytest.raises(RetriableKVError):
        kv.audit()
