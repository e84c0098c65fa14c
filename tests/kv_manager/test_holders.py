"""Holders and epochs, worker expiry, the memory-pressure signal, and the ledger's import purity."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from kv_manager import (
    BlockLedger,
    CommitItem,
    ExceedsCapacity,
    Holder,
    InvalidSize,
    OutOfBlocks,
    ReserveItem,
    StaleEpoch,
    UnknownRequest,
)
from tests.kv_manager.kv_helpers import DRAFT, TARGET, commit, free_list, prefill, ref_counts, reserve


def test_expire_worker_rolls_back_its_grants_and_refuses_late_commits(ledger: BlockLedger) -> None:
    dead = ledger.register_worker("verifier-0")
    live = ledger.register_worker("verifier-1")
    assert dead == Holder("verifier-0", 0)
    prefill(ledger, TARGET, "a", [1, 2, 3, 4, 5], dead)
    reserve(ledger, TARGET, "a", 5, dead)  # a round in flight on the worker about to die
    prefill(ledger, TARGET, "b", [9, 9], live)

    assert ledger.expire_worker("verifier-0") == 1
    assert ledger.request_ids(TARGET) == ["b"]
    assert ledger.block_table(TARGET, "b") == (3,)
    assert free_list(ledger)[:3] == [0, 1, 2]  # content died with the worker: nothing stays cached
    assert ledger.audit().counts[TARGET].cached == 0

    before = ledger.snapshot()
    with pytest.raises(StaleEpoch):
        ledger.commit_one(CommitItem(TARGET, "a", 1, [6], dead))
    with pytest.raises(StaleEpoch):
        ledger.reserve_one(ReserveItem(TARGET, "a", 1, dead))
    with pytest.raises(StaleEpoch):
        ledger.add_request(TARGET, "c", [1], dead)
    assert ledger.snapshot() == before
    assert ledger.expire_worker("verifier-0") == 0  # idempotent


def test_restarted_worker_gets_a_new_epoch_and_the_old_one_is_refused(ledger: BlockLedger) -> None:
    old = ledger.register_worker("w")
    prefill(ledger, TARGET, "r", [1, 2, 3], old)
    new = ledger.register_worker("w")  # re-registration = restart: the old epoch dies
    assert new == Holder("w", 1)
    assert ledger.request_ids(TARGET) == []
    ledger.add_request(TARGET, "r", [1, 2, 3], new)  # recovery: re-admit and re-prefill
    reserve(ledger, TARGET, "r", 3, new)
    before = ledger.snapshot()
    with pytest.raises(StaleEpoch):  # the late commit of the old epoch's round
        ledger.commit_one(CommitItem(TARGET, "r", 1, [1], old))
    assert ledger.snapshot() == before
    commit(ledger, TARGET, "r", [1, 2, 3], new)


def test_a_request_is_committed_only_by_its_own_holder(ledger: BlockLedger) -> None:
    owner = ledger.register_worker("w0")
    other = ledger.register_worker("w1")
    ledger.add_request(TARGET, "r", [1], owner)
    reserve(ledger, TARGET, "r", 2, owner)
    with pytest.raises(StaleEpoch, match="held by"):
        ledger.commit_one(CommitItem(TARGET, "r", 1, [1], other))


def test_expiry_forgets_cached_content_of_the_dead_workers_memory(ledger: BlockLedger) -> None:
    w0 = ledger.register_worker("w0")
    prompt = list(range(12))
    prefill(ledger, TARGET, "a", prompt, w0)
    ledger.release(TARGET, "a")
    assert ledger.audit().counts[TARGET].cached == 3
    ledger.expire_worker("w0")
    assert ledger.audit().counts[TARGET].cached == 0
    w1 = ledger.register_worker("w1")
    assert ledger.add_request(TARGET, "b", prompt, w1).num_cached_tokens == 0


def test_expiry_keeps_blocks_shared_with_live_requests(ledger: BlockLedger) -> None:
    w0 = ledger.register_worker("w0")
    w1 = ledger.register_worker("w1")
    prompt = list(range(12))
    prefill(ledger, TARGET, "a", prompt, w0)
    assert ledger.add_request(TARGET, "b", prompt, w1).block_table == (0, 1)
    ledger.expire_worker("w0")
    assert ref_counts(ledger, [0, 1, 2]) == [1, 1, 0]
    assert ledger.block_table(TARGET, "b") == (0, 1)


def test_unknown_request_after_expiry_with_a_live_holder(ledger: BlockLedger) -> None:
    w0 = ledger.register_worker("w0")
    ledger.add_request(DRAFT, "r", [1], w0)
    ledger.expire_worker("w0")
    w0 = ledger.register_worker("w0")
    with pytest.raises(UnknownRequest):
        ledger.reserve_one(ReserveItem(DRAFT, "r", 1, w0))


def test_can_admit_and_free_fraction(ledger: BlockLedger, holder: Holder) -> None:
    assert ledger.free_fraction(TARGET) == 1.0
    assert ledger.can_admit({TARGET: 64, DRAFT: 16})  # exactly all blocks of both
    ledger.add_request(TARGET, "r", [1], holder)
    reserve(ledger, TARGET, "r", 17, holder)  # 5 blocks
    assert ledger.free_fraction(TARGET) == 11 / 16
    assert ledger.can_admit({TARGET: 44})
    assert not ledger.can_admit({TARGET: 45})  # 12 blocks: fits the namespace, not now
    assert not ledger.can_admit({DRAFT: 4, TARGET: 48})  # one namespace short is enough
    with pytest.raises(ExceedsCapacity):
        ledger.can_admit({TARGET: 65})
    with pytest.raises(InvalidSize):
        ledger.can_admit({TARGET: -1})
    ledger.add_request(TARGET, "big", [1], holder)
    before = ledger.snapshot()
    with pytest.raises(OutOfBlocks):
        reserve(ledger, TARGET, "big", 45, holder)
    assert ledger.snapshot() == before


def test_errors_keep_their_fields_across_pickling() -> None:
    error = StaleEpoch("holder is dead", namespace=TARGET, request_id="r7")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is StaleEpoch
    assert (str(copy), copy.namespace, copy.request_id) == ("holder is dead", TARGET, "r7")
    assert str(UnknownRequest("unknown request 'x'")) == "unknown request 'x'"


def test_ledger_modules_import_neither_torch_nor_ray() -> None:
    code = (
        "import sys, kv_manager, kv_manager.ledger; "
        "bad = [m for m in ('torch', 'ray') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
