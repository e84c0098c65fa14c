"""Exact block ids and free-list order through reserve -> commit -> rollback -> release."""

from __future__ import annotations

import pytest

from kv_manager import (
    BlockLedger,
    BlockState,
    CommitItem,
    Holder,
    KVError,
    OutOfBlocks,
    Reservation,
    ReserveItem,
)
from tests.kv_manager.kv_helpers import (
    DRAFT,
    TARGET,
    commit,
    end_of_test_check,
    free_list,
    make_ledger,
    prefill,
    ref_counts,
    reserve,
)


def test_round_trip_exact_ids_and_free_list_order(ledger: BlockLedger, holder: Holder) -> None:
    admission = ledger.add_request(TARGET, "r1", list(range(10)), holder)
    assert admission.num_cached_tokens == 0 and admission.block_table == ()

    grant = reserve(ledger, TARGET, "r1", 10, holder)  # prefill
    assert grant.start_pos == 0
    assert grant.block_table == (0, 1, 2)
    assert grant.slot_mapping == tuple(range(10))
    assert grant.copy_on_write == ()
    assert free_list(ledger) == list(range(3, 16))

    result = commit(ledger, TARGET, "r1", list(range(10)), holder)
    assert (result.committed_len, result.block_table, result.num_freed_blocks) == (10, (0, 1, 2), 0)
    assert [ledger.pools[TARGET].blocks[b].state for b in (0, 1, 2)] == [BlockState.COMMITTED] * 3

    grant = reserve(ledger, TARGET, "r1", 5, holder)  # k = 4 drafts + 1
    assert grant.start_pos == 10
    assert grant.block_table == (0, 1, 2, 3)
    assert grant.slot_mapping == (10, 11, 12, 13, 14)
    assert grant.block_offsets() == [(2, 2), (2, 3), (3, 0), (3, 1), (3, 2)]
    assert ledger.pools[TARGET].blocks[3].state is BlockState.RESERVED

    result = ledger.commit_one(CommitItem(TARGET, "r1", 2, [10, 11], holder))  # 1 draft accepted
    assert (result.committed_len, result.block_table, result.num_freed_blocks) == (12, (0, 1, 2), 1)
    assert free_list(ledger) == list(range(3, 16))  # block 3 back at the head

    grant = reserve(ledger, TARGET, "r1", 5, holder)
    assert grant.block_table == (0, 1, 2, 3, 4)
    assert grant.slot_mapping == (12, 13, 14, 15, 16)
    assert ledger.rollback(TARGET, "r1") == 2
    assert ledger.reserved_len(TARGET, "r1") == 0 and ledger.block_table(TARGET, "r1") == (0, 1, 2)
    assert free_list(ledger) == list(range(3, 16))  # rolled-back blocks go to the head, in order

    assert reserve(ledger, TARGET, "r1", 5, holder).slot_mapping == (12, 13, 14, 15, 16)  # same ids again
    ledger.rollback(TARGET, "r1")

    assert ledger.release(TARGET, "r1") == 3
    # full content-hashed blocks go to the tail, last block first: evicted in that order
    assert free_list(ledger) == [*range(3, 16), 2, 1, 0]
    assert ledger.pools[TARGET].blocks[0].block_hash is not None


@pytest.mark.parametrize(
    ("committed_len", "num_slots", "new_blocks", "slot_mapping"),
    [
        (0, 1, (0,), (0,)),
        (0, 4, (0,), (0, 1, 2, 3)),
        (0, 5, (0, 1), (0, 1, 2, 3, 4)),
        (3, 1, (), (3,)),  # fits the partial block
        (3, 2, (1,), (3, 4)),  # crosses one boundary
        (4, 4, (1,), (4, 5, 6, 7)),  # exactly one new block
        (4, 5, (1, 2), (4, 5, 6, 7, 8)),
        (7, 9, (2, 3), (7, *range(8, 16))),  # crosses two boundaries
        (2, 14, (1, 2, 3), (2, 3, *range(4, 16))),
    ],
)
def test_lookahead_rounding_across_block_boundaries(
    committed_len: int, num_slots: int, new_blocks: tuple[int, ...], slot_mapping: tuple[int, ...]
) -> None:
    ledger = make_ledger()
    holder = ledger.register_worker("w")
    ledger.add_request(TARGET, "r", [9] * (committed_len + 1), holder)
    if committed_len:
        reserve(ledger, TARGET, "r", committed_len, holder)
        commit(ledger, TARGET, "r", [9] * committed_len, holder)
    table_before = ledger.block_table(TARGET, "r")
    free_before = ledger.pools[TARGET].num_free
    grant = reserve(ledger, TARGET, "r", num_slots, holder)
    assert grant.block_table == (*table_before, *new_blocks)
    assert grant.slot_mapping == slot_mapping
    assert ledger.pools[TARGET].num_free == free_before - len(new_blocks)
    end_of_test_check(ledger)


def test_accept_all_and_accept_none(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "r", [1, 2, 3], holder)
    reserve(ledger, TARGET, "r", 5, holder)  # positions 3..7
    result = commit(ledger, TARGET, "r", [4, 5, 6, 7, 8], holder)
    assert (result.committed_len, result.block_table) == (8, (0, 1))
    reserve(ledger, TARGET, "r", 5, holder)  # positions 8..12: blocks 2, 3
    result = ledger.commit_one(CommitItem(TARGET, "r", 0, [], holder))  # accept nothing = rollback
    assert (result.committed_len, result.block_table, result.num_freed_blocks) == (8, (0, 1), 2)
    assert free_list(ledger)[:2] == [2, 3]


def test_tree_commit_compacts_the_accepted_path(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "r", [1, 2], holder)
    grant = reserve(ledger, TARGET, "r", 6, holder)  # 6 tree nodes at positions 2..7
    assert grant.slot_mapping == (2, 3, 4, 5, 6, 7)
    # nodes 0 (root), 2 and 5 are the accepted path: 2 -> position 3, 5 -> position 4
    result = ledger.commit_one(CommitItem(TARGET, "r", 3, [7, 8, 9], holder, accepted_path=[0, 2, 5]))
    assert result.slot_moves == ((4, 3), (7, 4))
    assert (result.committed_len, result.block_table) == (5, (0, 1))


def test_commit_finished_releases_in_the_same_call(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "r", [1, 2, 3, 4, 5], holder)
    reserve(ledger, TARGET, "r", 3, holder)
    result = commit(ledger, TARGET, "r", [6], holder, finished=True)
    assert result.committed_len == 6
    assert ledger.request_ids(TARGET) == []
    assert ledger.pools[TARGET].num_free == 16


def test_batch_reserve_is_all_or_nothing_per_request() -> None:
    ledger = make_ledger(num_blocks=4)
    holder = ledger.register_worker("w")
    for request_id in ("a", "b", "c"):
        ledger.add_request(TARGET, request_id, [1], holder)
    items = [ReserveItem(TARGET, "a", 5, holder), ReserveItem(TARGET, "b", 9, holder), ReserveItem(TARGET, "c", 4, holder)]
    outcomes = ledger.reserve(items)
    assert isinstance(outcomes[0], Reservation) and outcomes[0].block_table == (0, 1)
    assert isinstance(outcomes[1], OutOfBlocks) and outcomes[1].request_id == "b"
    assert ledger.block_table(TARGET, "b") == () and ledger.reserved_len(TARGET, "b") == 0
    assert isinstance(outcomes[2], Reservation) and outcomes[2].block_table == (2,)
    assert free_list(ledger) == [3]
    end_of_test_check(ledger)


def test_atomic_batch_reserve_grants_all_or_none() -> None:
    ledger = make_ledger(num_blocks=4)
    holder = ledger.register_worker("w")
    for request_id in ("a", "b"):
        ledger.add_request(TARGET, request_id, [1], holder)
    before = ledger.snapshot()
    # each fits alone (2 + 3 blocks of 4), together they do not
    with pytest.raises(OutOfBlocks) as refusal:
        ledger.reserve([ReserveItem(TARGET, "a", 8, holder), ReserveItem(TARGET, "b", 12, holder)], atomic=True)
    assert refusal.value.request_id == "b"
    assert ledger.snapshot() == before
    grants = ledger.reserve(
        [ReserveItem(TARGET, "a", 8, holder), ReserveItem(TARGET, "b", 8, holder)], atomic=True
    )
    assert [g.block_table for g in grants if not isinstance(g, KVError)] == [(0, 1), (2, 3)]
    end_of_test_check(ledger)


def test_namespaces_have_their_own_block_ids(ledger: BlockLedger, holder: Holder) -> None:
    target = reserve_after_add(ledger, TARGET, holder, 6)
    draft = reserve_after_add(ledger, DRAFT, holder, 3)
    assert target.block_table == (0, 1) and target.slot_mapping == (0, 1, 2, 3, 4, 5)
    assert draft.block_table == (0, 1) and draft.slot_mapping == (0, 1, 2)  # block size 2
    ledger.release(TARGET, "r")
    assert ref_counts(ledger, [0, 1], DRAFT) == [1, 1]
    assert ledger.free_fraction(TARGET) == 1.0 and ledger.free_fraction(DRAFT) == 6 / 8


def reserve_after_add(ledger: BlockLedger, namespace: str, holder: Holder, num_slots: int) -> Reservation:
    ledger.add_request(namespace, "r", [1], holder)
    return reserve(ledger, namespace, "r", num_slots, holder)
