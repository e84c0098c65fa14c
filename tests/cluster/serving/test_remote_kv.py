"""RemoteKV: the scheduler's synchronous KV client. Free fractions ride on reserve/commit answers,
so a steady round costs two ledger calls; any other change marks them stale and the next read fetches.

Run under scripts/in-netns.sh (loopback only); Ray starts once per session (`ray_session`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from cluster.serving.remote_backends import RemoteKV
from kv_manager import AdmitItem, CommitItem, KVError, NamespaceConfig, ReserveItem
from kv_manager.actor import KVManagerActor

TARGET = "verifier/target"


class CountingKV(RemoteKV):
    def __init__(self, actor: Any) -> None:
        super().__init__(actor)
        self.calls: list[str] = []

    def _call(self, method: str, *args: Any) -> Any:
        self.calls.append(method)
        return super()._call(method, *args)


def test_free_fraction_costs_no_extra_call_in_a_round_and_is_exact(ray_session: ModuleType) -> None:
    actor = KVManagerActor.remote([NamespaceConfig(TARGET, num_blocks=8, block_size=4)])
    try:
        kv = CountingKV(actor)

        def actual() -> float:  # straight from the actor, not counted
            return ray_session.get(actor.free_fractions.remote(kv.incarnation))[TARGET]

        holder = kv.register_worker("verifier")
        kv.admit([AdmitItem(TARGET, "a", [1, 2, 3, 4, 5], holder)])
        kv.calls.clear()
        assert kv.free_fraction(TARGET) == actual() and kv.calls == ["free_fractions"]  # stale after admit
        for round_index in range(3):  # a round: reserve, read the fraction, commit, read it again
            kv.calls.clear()
            kv.reserve([ReserveItem(TARGET, "a", 4, holder)])
            assert kv.free_fraction(TARGET) == actual() < 1.0, round_index
            kv.commit([CommitItem(TARGET, "a", 1, [7], holder)])
            assert kv.free_fraction(TARGET) == actual(), round_index
            assert kv.calls == ["reserve_with_free", "commit_with_free"], round_index
        kv.calls.clear()  # a deferred commit with the next reserve: one call, fractions still exact
        kv.reserve([ReserveItem(TARGET, "a", 4, holder)])
        committed, reserved = kv.commit_then_reserve([CommitItem(TARGET, "a", 2, [7, 8], holder)],
                                                     [ReserveItem(TARGET, "a", 3, holder)])
        assert not isinstance(committed[0], KVError) and not isinstance(reserved[0], KVError)
        assert kv.free_fraction(TARGET) == actual()
        assert kv.calls == ["reserve_with_free", "commit_then_reserve_with_free"]
        kv.commit([CommitItem(TARGET, "a", 0, [], holder)])
        kv.release("a", [TARGET])
        kv.calls.clear()
        assert kv.free_fraction(TARGET) == 1.0 and kv.calls == ["free_fractions"]
        kv.audit().assert_no_leaks()
    finally:
        ray_session.kill(actor)
