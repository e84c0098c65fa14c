"""Prefix sharing: content-hashed full blocks, reference counts, copy on write, eviction order."""

from __future__ import annotations

from kv_manager import BlockLedger, Holder, Reservation, ReserveItem
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

PROMPT = list(range(100, 112))  # 12 tokens = 3 full blocks of 4


def test_second_identical_prompt_reuses_the_first_ones_blocks(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "r1", PROMPT, holder)
    assert ledger.block_table(TARGET, "r1") == (0, 1, 2)

    admission = ledger.add_request(TARGET, "r2", PROMPT, holder)
    # block 2 holds the last prompt token: never shared, its logits must be computed
    assert admission.num_cached_tokens == 8 and admission.block_table == (0, 1)
    assert ledger.committed_len(TARGET, "r2") == 8
    assert ref_counts(ledger, [0, 1, 2]) == [2, 2, 1]

    grant = reserve(ledger, TARGET, "r2", 4, holder)  # prefill only the rest
    assert grant.start_pos == 8 and grant.block_table == (0, 1, 3)
    result = commit(ledger, TARGET, "r2", PROMPT[8:], holder)
    # block 3 turned out identical to block 2: the table switches to the shared block, 3 is freed
    assert result.block_table == (0, 1, 2) and result.num_freed_blocks == 1
    assert ref_counts(ledger, [0, 1, 2, 3]) == [2, 2, 2, 0]
    assert free_list(ledger) == list(range(3, 16))

    assert ledger.release(TARGET, "r1") == 0  # still held by r2
    assert ref_counts(ledger, [0, 1, 2]) == [1, 1, 1]
    assert ledger.release(TARGET, "r2") == 3
    assert free_list(ledger) == [*range(3, 16), 2, 1, 0]


def test_prefix_hit_after_release_takes_cached_blocks_off_the_free_list(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "r1", PROMPT, holder)
    ledger.release(TARGET, "r1")
    assert ledger.audit().counts[TARGET].cached == 3

    admission = ledger.add_request(TARGET, "r2", [*PROMPT[:8], 7, 7], holder)  # shares 2 blocks, then differs
    assert admission.block_table == (0, 1)
    assert ref_counts(ledger, [0, 1]) == [1, 1]
    assert free_list(ledger) == [*range(3, 16), 2]


def test_divergent_prompts_share_only_the_common_full_blocks(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "r1", PROMPT, holder)
    other = [*PROMPT[:4], 0, 0, 0, 0, *PROMPT[8:]]  # block 2 equal in content, different prefix
    admission = ledger.add_request(TARGET, "r2", other, holder)
    assert admission.num_cached_tokens == 4 and admission.block_table == (0,)
    reserve(ledger, TARGET, "r2", 8, holder)
    result = commit(ledger, TARGET, "r2", other[4:], holder)
    assert result.block_table == (0, 3, 4)  # the chained hash keeps block 4 apart from block 2
    assert ref_counts(ledger, [0, 1, 2, 3, 4]) == [2, 1, 1, 1, 1]


def test_eviction_takes_uncached_blocks_first_then_lru_cached() -> None:
    ledger = make_ledger(num_blocks=6)
    holder = ledger.register_worker("w")
    prefill(ledger, TARGET, "old", PROMPT, holder)  # blocks 0, 1, 2
    ledger.release(TARGET, "old")
    assert free_list(ledger) == [3, 4, 5, 2, 1, 0]
    ledger.add_request(TARGET, "big", [1], holder)
    grant = reserve(ledger, TARGET, "big", 16, holder)  # 4 blocks: 3 uncached, then evicts block 2
    assert grant.block_table == (3, 4, 5, 2)
    assert ledger.pools[TARGET].blocks[2].block_hash is None
    ledger.release(TARGET, "big")
    admission = ledger.add_request(TARGET, "again", PROMPT, holder)
    assert admission.block_table == (0, 1)  # blocks 0 and 1 survived as cache hits
    end_of_test_check(ledger)


def test_fork_shares_every_block_and_copies_the_partial_one_on_write(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "parent", [1, 2, 3, 4, 5, 6], holder)  # block 0 full, block 1 holds 2 tokens
    child = ledger.fork(TARGET, "parent", "child")
    assert child.block_table == (0, 1) and child.num_cached_tokens == 6
    assert ref_counts(ledger, [0, 1]) == [2, 2]

    grant = reserve(ledger, TARGET, "child", 3, holder)  # positions 6..8 would write into shared block 1
    assert grant.copy_on_write == ((1, 2),)
    assert grant.block_table == (0, 2, 3)
    assert grant.slot_mapping == (10, 11, 12)
    assert ref_counts(ledger, [0, 1, 2, 3]) == [2, 1, 1, 1]
    assert ledger.pools[TARGET].blocks[2].committed_slots == 2

    grant = reserve(ledger, TARGET, "parent", 1, holder)  # block 1 is the parent's alone now: no copy
    assert grant.copy_on_write == () and grant.slot_mapping == (6,)

    commit(ledger, TARGET, "child", [7, 8, 9], holder)
    commit(ledger, TARGET, "parent", [70], holder)
    assert ledger.block_table(TARGET, "child") == (0, 2, 3)
    assert ledger.block_table(TARGET, "parent") == (0, 1)
    ledger.release(TARGET, "parent")
    assert ref_counts(ledger, [0, 1]) == [1, 0]


def test_fork_of_full_blocks_needs_no_copy(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "parent", [1, 2, 3, 4], holder)
    ledger.fork(TARGET, "parent", "c1")
    ledger.fork(TARGET, "parent", "c2")
    assert ref_counts(ledger, [0]) == [3]
    grant = reserve(ledger, TARGET, "c1", 2, holder)
    assert grant.copy_on_write == () and grant.block_table == (0, 1)


def test_prefix_sharing_off_and_across_namespaces(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, DRAFT, "r1", PROMPT, holder)  # prefix caching off in the draft namespace
    assert ledger.add_request(DRAFT, "r2", PROMPT, holder).num_cached_tokens == 0
    assert ledger.add_request(TARGET, "r1", PROMPT, holder).num_cached_tokens == 0  # no cross-namespace hits
    ledger.release(DRAFT, "r1")
    assert ledger.audit().counts[DRAFT].cached == 0


def test_atomic_batch_of_fork_siblings_copies_only_once(ledger: BlockLedger, holder: Holder) -> None:
    prefill(ledger, TARGET, "parent", [1, 2, 3, 4, 5, 6], holder)
    ledger.fork(TARGET, "parent", "child")
    parent_grant, child_grant = ledger.reserve(
        [ReserveItem(TARGET, "parent", 1, holder), ReserveItem(TARGET, "child", 1, holder)], atomic=True
    )
    assert isinstance(parent_grant, Reservation) and isinstance(child_grant, Reservation)
    assert (parent_grant.copy_on_write, parent_grant.block_table, parent_grant.slot_mapping) == (((1, 2),), (0, 2), (10,))
    # the parent's copy left block 1 to the child alone: it writes in place
    assert (child_grant.copy_on_write, child_grant.block_table, child_grant.slot_mapping) == ((), (0, 1), (6,))
    assert ref_counts(ledger, [0, 1, 2]) == [2, 1, 1]
