"""Reservation windows: a commit that keeps the reservation's rest (`keep_reserved`) and a reserve that grows
the reservation in flight (`extend`), as the engine uses them to grant the next round during this one's verify."""

from __future__ import annotations

import pytest

from kv_manager import BlockLedger, BlockState, CommitItem, Holder, OutOfBlocks, ReserveItem
from kv_manager.errors import ReservationInFlight
from tests.kv_manager.kv_helpers import TARGET, end_of_test_check, free_list, make_ledger, prefill


def extend(ledger: BlockLedger, request_id: str, num_slots: int, holder: Holder):  # noqa: ANN201
    return ledger.reserve_one(ReserveItem(TARGET, request_id, num_slots, holder, extend=True))


def keep_commit(ledger: BlockLedger, request_id: str, tokens: list[int], holder: Holder, **kwargs: object):  # noqa: ANN201
    return ledger.commit_one(CommitItem(TARGET, request_id, len(tokens), tokens, holder, keep_reserved=True,
                                        **kwargs))  # type: ignore[arg-type]


def test_extend_grows_the_window_and_keeps_its_slots(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "r", list(range(6)), holder)  # blocks 0, 1; positions 0-5 committed
    first = extend(ledger, "r", 3, holder)  # no reservation in flight: a plain reserve
    assert (first.start_pos, first.slot_mapping, first.copy_on_write) == (6, (6, 7, 8), ())
    grown = extend(ledger, "r", 7, holder)  # the window grows; its first slots stay where they were
    assert grown.start_pos == 6 and grown.slot_mapping[:3] == first.slot_mapping and len(grown.slot_mapping) == 7
    assert ledger.reserved_len(TARGET, "r") == 7
    same = extend(ledger, "r", 2, holder)  # never shrinks
    assert same.slot_mapping == grown.slot_mapping
    end_of_test_check(ledger)


def test_a_plain_reserve_is_still_refused_with_a_window_in_flight(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "r", list(range(6)), holder)
    extend(ledger, "r", 3, holder)
    with pytest.raises(ReservationInFlight):
        ledger.reserve_one(ReserveItem(TARGET, "r", 2, holder))
    end_of_test_check(ledger)


def test_keep_reserved_commit_moves_the_window_forward(ledger: BlockLedger, holder: Holder) -> None:
    """Round r's slots [6, 9), then r + 1's [6, 14) granted during r's verify; r accepts 2: the window is [8, 14)
    on the same slots, and blocks wholly past the committed positions stay reserved."""
    prefill(ledger, TARGET, "r", list(range(6)), holder)
    extend(ledger, "r", 3, holder)
    window = extend(ledger, "r", 8, holder)
    result = keep_commit(ledger, "r", [6, 7], holder)
    assert result.committed_len == 8 and result.num_freed_blocks == 0
    assert ledger.reserved_len(TARGET, "r") == 6
    table = ledger.block_table(TARGET, "r")
    assert [ledger.pools[TARGET].blocks[b].state for b in table] == [BlockState.COMMITTED] * 2 + \
        [BlockState.RESERVED] * 2
    after = extend(ledger, "r", 6, holder)  # what the next round is granted: the window's rest, unchanged
    assert after.start_pos == 8 and after.slot_mapping == window.slot_mapping[2:]
    ledger.assert_no_leaks()
    final = ledger.commit_one(CommitItem(TARGET, "r", 1, [8], holder))  # without keep: the rest goes back
    assert final.committed_len == 9 and final.num_freed_blocks == 1 and ledger.reserved_len(TARGET, "r") == 0
    end_of_test_check(ledger)


def test_keep_reserved_with_nothing_accepted_and_with_finished(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "r", list(range(4)), holder)
    extend(ledger, "r", 5, holder)
    keep_commit(ledger, "r", [], holder)
    assert ledger.committed_len(TARGET, "r") == 4 and ledger.reserved_len(TARGET, "r") == 5
    free_before = len(free_list(ledger))
    keep_commit(ledger, "r", [4], holder, finished=True)  # finished: released whatever keep says
    assert "r" not in ledger.request_ids(TARGET) and len(free_list(ledger)) == free_before + 3
    end_of_test_check(ledger)


def test_a_refused_extend_changes_nothing(holder: Holder) -> None:
    ledger = make_ledger(num_blocks=6)
    holder = ledger.register_worker(holder.worker_id)
    prefill(ledger, TARGET, "r", list(range(6)), holder)
    prefill(ledger, TARGET, "other", list(range(100, 108)), holder)  # 2 of the 6 blocks free
    extend(ledger, "r", 2, holder)
    before = ledger.snapshot()
    with pytest.raises(OutOfBlocks):
        extend(ledger, "r", 11, holder)  # positions up to 16: 5 blocks, 3 of them new
    assert ledger.snapshot() == before
    end_of_test_check(ledger)


def test_rollback_ends_the_window(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "r", list(range(6)), holder)
    extend(ledger, "r", 9, holder)
    assert ledger.rollback(TARGET, "r") == 2
    assert ledger.reserved_len(TARGET, "r") == 0 and ledger.block_table(TARGET, "r") == (0, 1)
    end_of_test_check(ledger)


def test_tree_commit_with_keep_compacts_and_keeps_the_rest(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "r", list(range(4)), holder)
    window = extend(ledger, "r", 8, holder)  # a 4-node tree, then the next round's 4
    result = keep_commit(ledger, "r", [10, 12], holder, accepted_path=[0, 2])
    assert result.slot_moves == ((window.slot_mapping[2], window.slot_mapping[1]),)
    assert ledger.committed_len(TARGET, "r") == 6 and ledger.reserved_len(TARGET, "r") == 6
    end_of_test_check(ledger)
