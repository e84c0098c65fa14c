"""Shared helpers of the kv_manager tests: a small two-namespace ledger and one-line round steps."""

from __future__ import annotations

from collections.abc import Sequence

from kv_manager import (
    Admission,
    BlockLedger,
    CommitItem,
    CommitResult,
    Holder,
    NamespaceConfig,
    Reservation,
    ReserveItem,
)

TARGET = "verifier/target"  # block_size 4, 16 blocks, prefix caching on
DRAFT = "drafter/draft"  # block_size 2, 8 blocks, prefix caching off


def make_ledger(num_blocks: int = 16, block_size: int = 4) -> BlockLedger:
    return BlockLedger(
        [
            NamespaceConfig(TARGET, num_blocks=num_blocks, block_size=block_size),
            NamespaceConfig(DRAFT, num_blocks=8, block_size=2, prefix_caching=False),
        ]
    )


def reserve(ledger: BlockLedger, namespace: str, request_id: str, num_slots: int, holder: Holder) -> Reservation:
    return ledger.reserve_one(ReserveItem(namespace, request_id, num_slots, holder))


def commit(
    ledger: BlockLedger,
    namespace: str,
    request_id: str,
    token_ids: Sequence[int],
    holder: Holder,
    **kwargs: object,
) -> CommitResult:
    return ledger.commit_one(CommitItem(namespace, request_id, len(token_ids), list(token_ids), holder, **kwargs))


def prefill(
    ledger: BlockLedger, namespace: str, request_id: str, prompt: Sequence[int], holder: Holder
) -> Admission:
    """Admit, reserve the uncached rest of the prompt, commit it (what the engine's first round does)."""
    admission = ledger.add_request(namespace, request_id, prompt, holder)
    rest = list(prompt[admission.num_cached_tokens :])
    reserve(ledger, namespace, request_id, len(rest), holder)
    commit(ledger, namespace, request_id, rest, holder)
    return admission


def free_list(ledger: BlockLedger, namespace: str = TARGET) -> list[int]:
    return list(ledger.pools[namespace].free_blocks)


def ref_counts(ledger: BlockLedger, block_ids: Sequence[int], namespace: str = TARGET) -> list[int]:
    return [ledger.pools[namespace].blocks[block_id].ref_count for block_id in block_ids]


def end_of_test_check(ledger: BlockLedger) -> None:
    """The leak check every test ends with: audit clean, then every request released, every block free."""
    ledger.assert_no_leaks()
    for namespace in ledger.pools:
        for request_id in ledger.request_ids(namespace):
            ledger.release(namespace, request_id)
    report = ledger.audit()
    report.assert_no_leaks()
    for namespace, counts in report.counts.items():
        assert counts.free == counts.capacity, (namespace, counts)
