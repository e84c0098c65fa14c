"""The ledger rebuilt from its client's record (kv_manager/live_state.py, kv_manager/rebuild.py), without Ray.

The stateful machine of test_ledger_stateful.py runs again with every call's answer fed to a `LiveRecord`, and one
more rule: the manager restarts (its ledger replaced by `rebuild_ledger(record.state())`), possibly with a call
whose answer was lost (applied by the dead manager, never recorded). After a rebuild the live part of the ledger
equals the old one's (tables, lengths, holders, ref counts, block states, hashes, the prefix index), so the
machine's simulated worker memory still reads back every committed token through the same block tables; its
teardown releases everything and finds every block free and nothing leaked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kv_manager import (
    Admission,
    AdmitItem,
    BlockLedger,
    CommitItem,
    Holder,
    KVError,
    NamespaceConfig,
    ReserveItem,
)
from kv_manager.errors import InconsistentLiveState
from kv_manager.live_state import LiveEntry, LiveRecord, LiveState, LiveWorker
from kv_manager.rebuild import rebuild_ledger
from tests.kv_manager.test_ledger_stateful import CONFIGS, KVLedgerMachine

TARGET = CONFIGS[0].name


class RecordingLedger:
    """A ledger whose every answer also goes to `record` (as RemoteKV feeds it); `inner` may be replaced."""

    def __init__(self, inner: BlockLedger, record: LiveRecord) -> None:
        self.inner = inner
        self.record = record

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def register_worker(self, worker_id: str) -> Holder:
        holder = self.inner.register_worker(worker_id)
        self.record.registered(holder)
        return holder

    def expire_worker(self, worker_id: str) -> int:
        dropped = self.inner.expire_worker(worker_id)
        self.record.expired(worker_id)
        return dropped

    def add_request(self, namespace: str, request_id: str, prompt: Sequence[int], holder: Holder) -> Admission:
        admission = self.inner.add_request(namespace, request_id, prompt, holder)
        self.record.admitted([AdmitItem(namespace, request_id, prompt, holder)], [admission])
        return admission

    def fork(self, namespace: str, parent_id: str, child_id: str) -> Admission:
        admission = self.inner.fork(namespace, parent_id, child_id)
        self.record.forked([(namespace, parent_id, child_id)], [admission])
        return admission

    def reserve(self, items: Sequence[ReserveItem], *, atomic: bool = False) -> list[Any]:
        outcomes = self.inner.reserve(items, atomic=atomic)
        self.record.reserved(items, outcomes)
        return outcomes

    def commit(self, items: Sequence[CommitItem]) -> list[Any]:
        outcomes = self.inner.commit(items)
        self.record.committed(items, outcomes)
        return outcomes

    def rollback(self, namespace: str, request_id: str, holder: Holder | None = None) -> int:
        freed = self.inner.rollback(namespace, request_id, holder)
        self.record.rolled_back([(namespace, request_id)], [freed])
        return freed

    def release(self, namespace: str, request_id: str, holder: Holder | None = None) -> int:
        freed = self.inner.release(namespace, request_id, holder)
        self.record.released([(namespace, request_id)])
        return freed


def live_part(ledger: BlockLedger) -> dict[str, Any]:
    """What a rebuild must give back: workers, entries, held blocks and their index entries (free blocks and
    their cached content are not kept)."""
    snapshot = ledger.snapshot()
    out: dict[str, Any] = {"workers": snapshot["workers"]}
    for name, pool in snapshot["namespaces"].items():
        held = {block_id: fields for block_id, fields in enumerate(pool["blocks"]) if fields[0] > 0}
        index = {h: b for h, b in pool["index"].items() if b in held}
        out[name] = {"requests": pool["requests"], "held": held, "index": index}
    return out


class RebuiltLedgerMachine(KVLedgerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.record = LiveRecord()
        for holder in self.holders.values():
            self.record.registered(holder)
        self.ledger = RecordingLedger(self.ledger, self.record)  # type: ignore[assignment]
        self.restarts = 0

    def _restart(self) -> None:
        """The manager died: a new one rebuilds its ledger from the client's record."""
        ledger: RecordingLedger = self.ledger  # type: ignore[assignment]
        acknowledged = live_part(ledger.inner)
        ledger.inner = rebuild_ledger(CONFIGS, self.record.state(), first_epoch=10**9 + self.restarts)
        self.restarts += 1
        assert live_part(ledger.inner) == acknowledged
        ledger.inner.assert_no_leaks()

    @rule()
    def manager_restarts(self) -> None:
        self._restart()

    @precondition(lambda self: self._keys(in_flight=False))
    @rule(data=st.data())
    def manager_dies_during_a_reserve(self, data: st.DataObject) -> None:
        """The dead manager granted the slots, the answer never came: the rebuilt ledger has no such grant."""
        namespace, request_id = data.draw(st.sampled_from(self._keys(in_flight=False)))
        m = self.model[(namespace, request_id)]
        before = self.ledger.snapshot()["namespaces"][namespace]["requests"][request_id]
        outcome = self.ledger.inner.reserve([ReserveItem(namespace, request_id, data.draw(st.integers(1, 9)),
                                                         m.holder)])[0]
        event("lost answer: reserve", type(outcome).__name__)
        self._restart_after_lost_answer()
        assert self.ledger.snapshot()["namespaces"][namespace]["requests"][request_id] == before

    @precondition(lambda self: self._keys(in_flight=True))
    @rule(data=st.data())
    def manager_dies_during_a_commit(self, data: st.DataObject) -> None:
        """The dead manager committed, the answer never came: the reservation is still in flight after the rebuild
        (the engine sends the commit again)."""
        namespace, request_id = data.draw(st.sampled_from(self._keys(in_flight=True)))
        m = self.model[(namespace, request_id)]
        before = self.ledger.snapshot()["namespaces"][namespace]["requests"][request_id]
        accepted = data.draw(st.integers(0, len(m.pending or ())))
        self.ledger.inner.commit([CommitItem(namespace, request_id, accepted, (m.pending or [])[:accepted], m.holder,
                                             finished=data.draw(st.booleans()))])
        self._restart_after_lost_answer()
        assert self.ledger.snapshot()["namespaces"][namespace]["requests"][request_id] == before

    def _restart_after_lost_answer(self) -> None:
        ledger: RecordingLedger = self.ledger  # type: ignore[assignment]
        ledger.inner = rebuild_ledger(CONFIGS, self.record.state(), first_epoch=10**9 + self.restarts)
        self.restarts += 1
        ledger.inner.assert_no_leaks()


TestRebuiltLedgerMachine = RebuiltLedgerMachine.TestCase
TestRebuiltLedgerMachine.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# -- by hand: exact ids, and what a rebuild refuses ------------------------------------------------------
def two_requests_a_fork_and_a_window() -> tuple[BlockLedger, RecordingLedger, Holder]:
    config = NamespaceConfig(TARGET, num_blocks=8, block_size=4)
    ledger = RecordingLedger(BlockLedger([config]), LiveRecord())
    holder = ledger.register_worker("verifier")
    prompt = [1, 2, 3, 4, 5, 6]
    for request_id in ("a", "b"):  # b's first block is a prefix hit on a's
        admission = ledger.add_request(TARGET, request_id, prompt, holder)
        rest = prompt[admission.num_cached_tokens:]
        ledger.reserve([ReserveItem(TARGET, request_id, len(rest), holder)])
        ledger.commit([CommitItem(TARGET, request_id, len(rest), rest, holder)])
    ledger.fork(TARGET, "a", "a#2")  # shares a's two blocks, the partial one too
    ledger.reserve([ReserveItem(TARGET, "a", 5, holder)])  # a window of 5 in flight
    ledger.commit([CommitItem(TARGET, "a", 1, [7], holder, keep_reserved=True)])  # 4 of it kept reserved
    return ledger.inner, ledger, holder


def test_a_rebuild_gives_back_ids_counts_and_windows_and_the_rounds_go_on() -> None:
    original, recorded, holder = two_requests_a_fork_and_a_window()
    assert original.block_table(TARGET, "a") == (0, 3, 4)  # 3: a's copy of the partial block it shared with a#2
    rebuilt = rebuild_ledger([original.pools[TARGET].config], recorded.record.state(), first_epoch=99)
    assert live_part(rebuilt) == live_part(original)
    pool = rebuilt.pools[TARGET]
    assert [pool.blocks[b].ref_count for b in range(5)] == [3, 1, 1, 1, 1]  # a, b and a#2 hold block 0
    assert rebuilt.reserved_len(TARGET, "a") == 4 and rebuilt.committed_len(TARGET, "a") == 7
    assert list(pool.free_blocks) == [5, 6, 7]
    recorded.inner = rebuilt  # the engine goes on: its window's commit, a new request's prefix hit, the ends
    [result] = recorded.commit([CommitItem(TARGET, "a", 2, [8, 9], holder)])
    assert not isinstance(result, KVError) and result.committed_len == 9
    hit = recorded.add_request(TARGET, "c", [1, 2, 3, 4, 5, 6, 7, 8, 9], holder)
    assert hit.num_cached_tokens == 8 and hit.block_table == (0, 3)  # a's second block, full now, is indexed
    assert recorded.register_worker("verifier").epoch == holder.epoch + 1  # an epoch above the kept one
    assert rebuilt.request_ids(TARGET) == []  # the re-registration dropped the old epoch's entries
    report = rebuilt.audit()
    report.assert_no_leaks()
    assert report.counts[TARGET].free == report.counts[TARGET].capacity


def test_an_empty_record_rebuilds_an_empty_ledger() -> None:
    ledger = rebuild_ledger(CONFIGS, LiveRecord().state())
    assert all(not ledger.request_ids(c.name) for c in CONFIGS)
    assert all(ledger.audit().counts[c.name].free == c.num_blocks for c in CONFIGS)


HOLDER = Holder("verifier", 5)
WORKERS = (LiveWorker("verifier", 5, True),)


def entry(request_id: str, table: tuple[int, ...], committed: int, reserved: int = 0,
          holder: Holder = HOLDER) -> LiveEntry:
    return LiveEntry(TARGET, request_id, holder, table, committed, reserved, tuple(range(committed)))


@pytest.mark.parametrize(("entries", "workers", "says"), [
    ((entry("a", (0, 1), 5), entry("b", (1,), 3)), WORKERS, "different committed slots"),
    ((entry("a", (0, 1), 4, 2), entry("b", (0, 1), 4, 2)), WORKERS, "reserved block 1 held by 2"),
    ((entry("a", (0,), 6),), WORKERS, "1 blocks for 6"),
    ((entry("a", (0, 99), 6),), WORKERS, "leaves the namespace"),
    ((entry("a", (0,), 3),), (LiveWorker("verifier", 5, False),), "not a live epoch"),
    ((entry("a", (0,), 3, holder=Holder("verifier", 4)),), WORKERS, "not a live epoch"),
    ((LiveEntry(TARGET, "a", HOLDER, (0,), 3, 0, (1, 2)),), WORKERS, "2 committed tokens"),
    ((LiveEntry("elsewhere", "a", HOLDER, (0,), 3, 0, (1, 2, 3)),), WORKERS, "unknown namespaces"),
])
def test_a_live_state_that_contradicts_itself_is_refused(entries: tuple[LiveEntry, ...],
                                                         workers: tuple[LiveWorker, ...], says: str) -> None:
    with pytest.raises(InconsistentLiveState, match=says):
        rebuild_ledger(CONFIGS, LiveState(workers, entries))


def test_refusals_change_nothing_in_the_record() -> None:
    original, recorded, holder = two_requests_a_fork_and_a_window()
    before = recorded.record.state()
    outcomes = recorded.reserve([ReserveItem(TARGET, "b", 100, holder), ReserveItem(TARGET, "zz", 1, holder)])
    outcomes += recorded.commit([CommitItem(TARGET, "b", 1, [1], holder)])  # nothing reserved
    assert all(isinstance(o, KVError) for o in outcomes)
    assert recorded.record.state() == before
    for key in [(TARGET, r) for r in original.request_ids(TARGET)]:
        recorded.release(*key)
    original.assert_no_leaks()
    assert recorded.record.state().entries == ()
