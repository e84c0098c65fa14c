"""The Ray actor: typed errors through the client, 200 concurrent requests with cancellations, restarts.

Run under scripts/in-netns.sh (loopback only); Ray starts once per session (`ray_session`).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from types import ModuleType

import pytest
from ray.exceptions import RayActorError

from kv_manager import (
    Admission,
    AdmitItem,
    CommitItem,
    Holder,
    KVError,
    KVManagerClient,
    NamespaceConfig,
    OutOfBlocks,
    Reservation,
    ReserveItem,
    RetriableKVError,
    StaleEpoch,
    UnknownRequest,
)
from tests.kv_manager.kv_helpers import DRAFT, TARGET

NUM_REQUESTS = 200
PREFIXES = [[base] * 8 for base in range(5)]  # 5 shared prompt prefixes of 2 blocks


def test_typed_errors_and_stale_epochs_through_the_client(ray_session: ModuleType) -> None:
    client = KVManagerClient.create([NamespaceConfig(TARGET, num_blocks=4, block_size=4)])

    async def scenario() -> None:
        holder = await client.register_worker("w0")
        admissions = await client.add_requests([AdmitItem(TARGET, r, [1, 2, 3], holder) for r in ("a", "b")])
        assert all(isinstance(a, Admission) and a.num_cached_tokens == 0 for a in admissions)
        grant, missing = await client.reserve([ReserveItem(TARGET, "a", 5, holder), ReserveItem(TARGET, "x", 1, holder)])
        assert isinstance(grant, Reservation) and grant.slot_mapping == (0, 1, 2, 3, 4)
        assert isinstance(missing, UnknownRequest) and missing.request_id == "x"
        with pytest.raises(OutOfBlocks) as refusal:  # 3 blocks wanted, 2 free
            await client.reserve([ReserveItem(TARGET, "b", 12, holder)], atomic=True)
        assert refusal.value.request_id == "b" and refusal.value.namespace == TARGET
        assert await client.free_fractions() == {TARGET: 0.5}
        assert await client.can_admit({TARGET: 8}) and not await client.can_admit({TARGET: 9})
        assert await client.expire_worker("w0") == 2
        [late] = await client.commit([CommitItem(TARGET, "a", 1, [1], holder)])
        assert isinstance(late, StaleEpoch)
        assert await client.free_fractions() == {TARGET: 1.0}
        await client.assert_no_leaks()

    try:
        asyncio.run(scenario())
    finally:
        ray_session.kill(client.handle, no_restart=True)


async def _one_request(client: KVManagerClient, index: int, holder: Holder, rng: random.Random) -> str:
    """Admit, prefill, run 2-5 speculative rounds (target k+1 slots, draft k), release on every exit."""
    request_id = f"req-{index}"
    prompt = [*PREFIXES[index % len(PREFIXES)], *(rng.randrange(50) for _ in range(rng.randint(1, 12)))]
    keys = [(TARGET, request_id), (DRAFT, request_id)]
    admitted = False
    try:
        admitted = True  # before the call: a cancellation may land after the actor admitted the request
        admissions = await client.add_requests([AdmitItem(ns, request_id, prompt, holder) for ns, _ in keys])
        assert all(isinstance(a, Admission) for a in admissions), admissions
        cached = [a.num_cached_tokens for a in admissions]
        await client.reserve(
            [ReserveItem(ns, request_id, len(prompt) - c, holder) for (ns, _), c in zip(keys, cached, strict=True)],
            atomic=True,
        )
        await asyncio.sleep(rng.random() * 0.01)  # the prefill forward
        await client.commit(
            [CommitItem(ns, request_id, len(prompt) - c, prompt[c:], holder) for (ns, _), c in zip(keys, cached, strict=True)]
        )
        for _ in range(rng.randint(2, 5)):
            k = rng.randint(1, 4)
            await client.reserve([ReserveItem(TARGET, request_id, k + 1, holder), ReserveItem(DRAFT, request_id, k, holder)],
                                 atomic=True)
            await asyncio.sleep(rng.random() * 0.01)  # propose + verify
            accepted = rng.randint(0, k)
            tokens = [rng.randrange(50) for _ in range(accepted + 1)]
            outcomes = await client.commit(
                [CommitItem(TARGET, request_id, accepted + 1, tokens, holder),
                 CommitItem(DRAFT, request_id, accepted, tokens[:accepted], holder)]
            )
            assert not any(isinstance(o, KVError) for o in outcomes), outcomes
        return "finished"
    except OutOfBlocks:
        return "preempted"
    finally:
        if admitted:
            await client.release(keys)


def test_200_concurrent_requests_with_random_cancellations_leak_nothing(ray_session: ModuleType) -> None:
    configs = [NamespaceConfig(TARGET, num_blocks=400, block_size=4), NamespaceConfig(DRAFT, 300, 4, prefix_caching=False)]
    client = KVManagerClient.create(configs)
    rng = random.Random(7)

    async def scenario() -> Counter[str]:
        await client.connect()
        holders = [await client.register_worker(f"worker-{w}") for w in range(4)]
        tasks = [
            asyncio.create_task(_one_request(client, index, holders[index % len(holders)], rng))
            for index in range(NUM_REQUESTS)
        ]
        loop = asyncio.get_running_loop()
        for task in rng.sample(tasks, 60):
            loop.call_later(rng.uniform(0.0, 0.2), task.cancel)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        unexpected = [r for r in results if not isinstance(r, (str, asyncio.CancelledError))]
        assert not unexpected, unexpected[:3]
        report = await client.audit()
        report.assert_no_leaks()
        assert all(c.free == c.capacity for c in report.counts.values()), report.counts
        return Counter(r if isinstance(r, str) else "cancelled" for r in results)

    try:
        tally = asyncio.run(scenario())
    finally:
        ray_session.kill(client.handle, no_restart=True)
    print(f"200 concurrent requests: {dict(tally)}")
    assert sum(tally.values()) == NUM_REQUESTS
    assert tally["finished"] > 0 and tally["cancelled"] > 0


def test_restart_empties_the_ledger_and_in_flight_rounds_get_a_retriable_error(ray_session: ModuleType) -> None:
    client = KVManagerClient.create([NamespaceConfig(TARGET, num_blocks=16, block_size=4)])
    prompt = list(range(10))

    async def scenario() -> None:
        first = await client.connect()
        holder = await client.register_worker("w0")
        await client.add_requests([AdmitItem(TARGET, "r", prompt, holder)])
        await client.reserve([ReserveItem(TARGET, "r", 10, holder)])
        await client.commit([CommitItem(TARGET, "r", 10, prompt, holder)])
        committed_tokens = list(prompt)  # the scheduler's truth
        await client.reserve([ReserveItem(TARGET, "r", 3, holder)])  # a round in flight

        ray_session.kill(client.handle, no_restart=False)  # a crash: Ray restarts the actor
        await _wait_for_restart(client, first)
        with pytest.raises(RetriableKVError):
            await client.commit([CommitItem(TARGET, "r", 2, [10, 11], holder)])
        with pytest.raises(RetriableKVError):  # every call stays void until the client reconnects
            await client.reserve([ReserveItem(TARGET, "r", 3, holder)])

        assert await client.connect() != first
        report = await client.audit()
        assert report.counts[TARGET].free == 16 and report.ok  # the new ledger starts empty
        new_holder = await client.register_worker("w0")
        assert new_holder.epoch > holder.epoch  # the old epoch never comes back
        [late] = await client.commit([CommitItem(TARGET, "r", 2, [10, 11], holder)])
        assert isinstance(late, StaleEpoch)

        # recovery: re-admit and re-prefill from the committed tokens
        [admission] = await client.add_requests([AdmitItem(TARGET, "r", committed_tokens, new_holder)])
        assert admission.num_cached_tokens == 0
        [grant] = await client.reserve([ReserveItem(TARGET, "r", len(committed_tokens), new_holder)])
        assert isinstance(grant, Reservation) and grant.start_pos == 0
        [result] = await client.commit([CommitItem(TARGET, "r", 10, committed_tokens, new_holder, finished=True)])
        assert not isinstance(result, KVError) and result.committed_len == 10
        await client.assert_no_leaks()

    try:
        asyncio.run(scenario())
    finally:
        ray_session.kill(client.handle, no_restart=True)


async def _wait_for_restart(client: KVManagerClient, old_incarnation: str) -> None:
    """Poll the raw handle (not the client, which keeps its old incarnation) until a new instance answers."""
    for _ in range(300):
        try:
            if await client.handle.incarnation.remote() != old_incarnation:
                return
        except RayActorError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("the kv manager actor did not restart")


def test_a_dead_actor_gives_a_retriable_error(ray_session: ModuleType) -> None:
    client = KVManagerClient.create([NamespaceConfig(TARGET, num_blocks=4, block_size=4)])

    async def scenario() -> None:
        await client.connect()
        ray_session.kill(client.handle, no_restart=True)
        with pytest.raises(RetriableKVError):
            await client.free_fractions()

    asyncio.run(scenario())
