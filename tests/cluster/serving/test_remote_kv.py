"""RemoteKV: the scheduler's KV client. Free fractions ride on reserve/commit answers, so a round costs no
extra call to read them; any other change marks them stale and the next read fetches. The ahead call (beside a
verify) goes on its own connection.

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

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(method)
        return super()._call(method, *args, **kwargs)


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


def test_the_ahead_call_goes_on_its_own_connection_and_keeps_the_window(ray_session: ModuleType) -> None:
    actor = KVManagerActor.remote([NamespaceConfig(TARGET, num_blocks=8, block_size=4)])
    try:
        kv = CountingKV(actor)
        holder = kv.register_worker("verifier")
        kv.admit([AdmitItem(TARGET, "a", [1, 2, 3, 4, 5], holder)])
        kv.reserve([ReserveItem(TARGET, "a", 4, holder)])
        kv.calls.clear()
        future = kv.commit_then_reserve_ahead([CommitItem(TARGET, "a", 2, [7, 8], holder, keep_reserved=True)],
                                              [ReserveItem(TARGET, "a", 7, holder, extend=True)])
        committed, reserved = future.result()
        assert committed[0].committed_len == 2 and reserved[0].start_pos == 2 and len(reserved[0].slot_mapping) == 7
        assert kv.calls == []  # not on the round's connection
        assert kv.free_fraction(TARGET) == ray_session.get(actor.free_fractions.remote(kv.incarnation))[TARGET]
        assert kv.ahead_link.totals().calls == 1
        kv.commit([CommitItem(TARGET, "a", 1, [9], holder, finished=True)])
        kv.audit().assert_no_leaks()
    finally:
        ray_session.kill(actor)
