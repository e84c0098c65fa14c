"""HeldCommitKV's reservation windows over a real ledger: a round granted from its window makes no ledger call
and gets the ledger's own slots; a window outgrown or refused falls back to the round's own call; a commit's
table change reaches the window; every test ends with the ledger's audit clean."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.engine.held_commit import HeldCommitKV
from cluster.engine.kv_client import LocalKV
from kv_manager import BlockLedger, CommitItem, NamespaceConfig, Reservation, ReserveItem
from kv_manager.errors import RetriableKVError
from kv_manager.schema import AdmitItem
from tests.cluster.engine.engine_helpers import fake_engine, fake_greedy, request

TARGET = "verifier/target"


class Counting(LocalKV):
    def __init__(self, ledger: BlockLedger) -> None:
        super().__init__(ledger)
        self.calls: list[str] = []

    def reserve(self, items: Any) -> Any:
        self.calls.append("reserve")
        return super().reserve(items)

    def commit(self, items: Any) -> Any:
        self.calls.append("commit")
        return super().commit(items)

    def commit_then_reserve(self, commits: Any, reserves: Any) -> Any:
        self.calls.append("commit_then_reserve")
        return self.ledger.commit(commits), self.ledger.reserve(reserves)

    def commit_then_reserve_ahead(self, commits: Any, reserves: Any) -> Any:
        self.calls.append("ahead")
        return LocalKV(self.ledger).commit_then_reserve_ahead(commits, reserves)


def make(num_blocks: int = 32, prefix_caching: bool = True) -> tuple[HeldCommitKV, Counting, BlockLedger]:
    ledger = BlockLedger([NamespaceConfig(TARGET, num_blocks=num_blocks, block_size=4,
                                          prefix_caching=prefix_caching)])
    inner = Counting(ledger)
    checked: list[Any] = []
    return HeldCommitKV(inner, lambda items, outcomes: checked.append(outcomes)), inner, ledger


def one_round(kv: HeldCommitKV, holder: Any, rid: str, slots: int, tokens: list[int], window: int) -> Reservation:
    """reserve, the ahead call (as the engine sends it beside the verify), land, held commit."""
    (grant,) = kv.reserve([ReserveItem(TARGET, rid, slots, holder)])
    assert isinstance(grant, Reservation)
    ahead = kv.ahead([ReserveItem(TARGET, rid, slots + window, holder)])
    assert ahead is not None
    kv.land_ahead(ahead)
    kv.commit([CommitItem(TARGET, rid, len(tokens), tokens, holder)], hold=True)
    return grant


def test_steady_rounds_are_granted_from_the_window_with_the_ledgers_slots() -> None:
    kv, inner, ledger = make()
    holder = kv.register_worker("verifier")
    kv.admit([AdmitItem(TARGET, "r", [1, 2, 3, 4, 5, 6], holder)])
    one_round(kv, holder, "r", 6, [1, 2, 3, 4, 5, 6], window=4)  # the prefill: a plain reserve, then a window
    for step in range(5):
        inner.calls.clear()
        start = ledger.committed_len(TARGET, "r") + (2 if step else 6)  # the held commit counted
        grant = one_round(kv, holder, "r", 4, [10 + step, 20 + step], window=4)
        assert inner.calls == ["ahead"], step  # nothing before the verify
        assert grant.start_pos == start
        state = ledger.requests[TARGET]["r"]
        table = state.block_table
        assert grant.slot_mapping == tuple(table[p // 4] * 4 + p % 4 for p in range(start, start + 4))
    kv.commit([CommitItem(TARGET, "r", 1, [99], holder, finished=True)])
    assert "r" not in ledger.request_ids(TARGET) and not kv.windows
    ledger.assert_no_leaks()
    assert ledger.audit().counts[TARGET].free == 32


def test_an_outgrown_window_extends_in_the_rounds_own_call() -> None:
    kv, inner, ledger = make()
    holder = kv.register_worker("verifier")
    kv.admit([AdmitItem(TARGET, "r", [1, 2, 3], holder)])
    one_round(kv, holder, "r", 3, [1, 2, 3], window=2)
    inner.calls.clear()
    (grant,) = kv.reserve([ReserveItem(TARGET, "r", 9, holder)])  # a tree larger than the window
    assert inner.calls == ["commit_then_reserve"] and isinstance(grant, Reservation)
    assert len(grant.slot_mapping) == 9 and ledger.reserved_len(TARGET, "r") == 9
    kv.rollback([(TARGET, "r")])
    assert not kv.windows and ledger.reserved_len(TARGET, "r") == 0
    kv.release("r", [TARGET])
    ledger.assert_no_leaks()


def test_a_refused_extend_keeps_the_window_and_the_next_round_still_gets_its_slots() -> None:
    kv, inner, ledger = make(num_blocks=4, prefix_caching=False)
    holder = kv.register_worker("verifier")
    kv.admit([AdmitItem(TARGET, "r", [1, 2, 3], holder)])
    one_round(kv, holder, "r", 3, [1, 2, 3], window=3)  # window to position 6: blocks 0, 1
    kv.admit([AdmitItem(TARGET, "other", [5, 6, 7, 8, 9], holder)])
    kv.reserve([ReserveItem(TARGET, "other", 5, holder)])  # the last two blocks
    inner.calls.clear()
    grant = one_round(kv, holder, "r", 2, [4, 5], window=8)  # its extend is refused: out of blocks
    assert grant.start_pos == 3 and ledger.reserved_len(TARGET, "r") == 3  # the window as it was; commit held
    assert len(kv.windows[(TARGET, "r")].grant.slot_mapping) == 1  # what it has left past the held commit
    (nxt,) = kv.reserve([ReserveItem(TARGET, "r", 1, holder)])
    assert isinstance(nxt, Reservation) and nxt.start_pos == 5 and inner.calls == ["ahead"]
    kv.commit([CommitItem(TARGET, "r", 1, [7], holder, finished=True)])
    kv.rollback([(TARGET, "other")])
    kv.release("other", [TARGET])
    ledger.assert_no_leaks()


class LostAhead:
    """The in-process ledger, except that the ahead call cannot be sent (the ledger's actor is gone)."""

    def __init__(self, inner: LocalKV) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def commit_then_reserve_ahead(self, commits: Any, reserves: Any) -> Any:
        raise RetriableKVError("kv manager lost during commit_then_reserve_with_free (test)")


def test_a_lost_ledger_on_the_windowed_call_fails_the_round_not_the_verifier() -> None:
    engine = fake_engine(max_batch=2)
    engine.submit(request("r", [3, 4, 5], max_tokens=40, k=2, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv.windows, "steady rounds hold windows"
    engine.kv.inner = LostAhead(engine.kv.inner)
    with pytest.raises(RetriableKVError):
        engine.step()
    assert engine.health._verifier_failures == 0  # the verify answered; the ledger is what failed


def test_windows_on_and_off_decode_the_same_tokens_and_leave_nothing() -> None:
    outputs = []
    for windows in (True, False):
        engine = fake_engine(max_batch=4, reservation_windows=windows)
        for index, prompt in enumerate(([3, 4, 5], [6, 7], [8, 9, 10, 11, 12])):
            engine.submit(request(f"r{index}", prompt, max_tokens=30, k=3 if index else None, ignore_eos=True))
        out = {rid: [t for c in chunks for t in c.token_ids] for rid, chunks in engine.run_to_completion().items()}
        assert out == {f"r{i}": fake_greedy(p, 30) for i, p in enumerate(([3, 4, 5], [6, 7], [8, 9, 10, 11, 12]))}
        assert not engine.kv.windows
        engine.check_ledger()
        engine.kv.audit().assert_no_leaks()
        outputs.append(out)
    assert outputs[0] == outputs[1]
