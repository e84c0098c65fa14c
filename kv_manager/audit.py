"""Consistency audit and snapshot of the ledger: one pass over blocks and block tables, O(blocks + entries).

Checked per namespace:
  - every block is in exactly one state, and that state agrees with its ref count and the free list
  - a block's ref count equals the number of live block tables holding it
  - no block table holds a free block or the same block twice
  - a table covers exactly its committed + reserved positions; committed blocks hold exactly the
    committed slots, blocks past committed_len are reserved
  - the prefix-cache index points at blocks carrying that hash
  - free + reserved + committed = capacity
A block with ref count > 0 that no live table holds is a leak.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kv_manager.block_pool import BlockPool
from kv_manager.request_blocks import RequestBlocks, cdiv
from kv_manager.schema import AuditReport, BlockState, NamespaceCounts, WorkerEpoch


def audit_ledger(
    pools: Mapping[str, BlockPool], requests: Mapping[str, Mapping[str, RequestBlocks]]
) -> AuditReport:
    counts: dict[str, NamespaceCounts] = {}
    leaked: list[tuple[str, int]] = []
    errors: list[str] = []
    for name, pool in pools.items():
        holders = _check_tables(name, pool, requests[name], errors)
        tally = dict.fromkeys(BlockState, 0)
        cached = 0
        for block in pool.blocks:
            block_id = block.block_id
            tally[block.state] += 1
            on_free_list = block_id in pool.free_blocks
            if block.state is BlockState.FREE:
                if block.ref_count or block.committed_slots or not on_free_list:
                    errors.append(f"{name}: free block {block_id} is inconsistent: {block}")
                if holders[block_id]:
                    errors.append(f"{name}: free block {block_id} is in {holders[block_id]} block tables")
                if block.block_hash is not None:
                    cached += 1
                    if pool.hash_to_block.get(block.block_hash) != block_id:
                        errors.append(f"{name}: free block {block_id} keeps an unindexed hash")
                continue
            if on_free_list:
                errors.append(f"{name}: {block.state.value} block {block_id} is on the free list")
            if block.ref_count <= 0:
                errors.append(f"{name}: {block.state.value} block {block_id} has ref count {block.ref_count}")
            elif holders[block_id] == 0:
                leaked.append((name, block_id))
            elif block.ref_count != holders[block_id]:
                errors.append(f"{name}: block {block_id} ref count {block.ref_count} != {holders[block_id]} tables")
            if (block.state is BlockState.COMMITTED) != (block.committed_slots > 0):
                errors.append(f"{name}: block {block_id} state {block.state.value} with {block.committed_slots} committed slots")
        if len(pool.free_blocks) != tally[BlockState.FREE]:
            errors.append(f"{name}: free list has {len(pool.free_blocks)} entries, {tally[BlockState.FREE]} free blocks")
        for block_hash, block_id in pool.hash_to_block.items():
            if pool.blocks[block_id].block_hash != block_hash:
                errors.append(f"{name}: index entry for block {block_id} does not match its hash")
        if sum(tally.values()) != pool.num_blocks:
            errors.append(f"{name}: counts {tally} do not add up to {pool.num_blocks}")
        counts[name] = NamespaceCounts(
            capacity=pool.num_blocks,
            free=tally[BlockState.FREE],
            reserved=tally[BlockState.RESERVED],
            committed=tally[BlockState.COMMITTED],
            cached=cached,
        )
    return AuditReport(counts=counts, leaked_blocks=tuple(leaked), errors=tuple(errors))


def _check_tables(
    name: str, pool: BlockPool, requests: Mapping[str, RequestBlocks], errors: list[str]
) -> list[int]:
    """Count the tables holding each block, checking each table against its request's lengths."""
    bs = pool.block_size
    holders = [0] * pool.num_blocks
    for request_id, state in requests.items():
        table = state.block_table
        if len(set(table)) != len(table):
            errors.append(f"{name}/{request_id}: block table {table} holds a block twice")
        num_positions = state.committed_len + state.reserved_len
        if len(table) != cdiv(num_positions, bs):
            errors.append(f"{name}/{request_id}: {len(table)} blocks for {num_positions} positions")
        for index, block_id in enumerate(table):
            holders[block_id] += 1
            expected_committed = max(0, min(bs, state.committed_len - index * bs))
            if pool.blocks[block_id].committed_slots != expected_committed:
                errors.append(
                    f"{name}/{request_id}: block {block_id} holds {pool.blocks[block_id].committed_slots} "
                    f"committed slots, expected {expected_committed}"
                )
    return holders


def snapshot_ledger(
    pools: Mapping[str, BlockPool],
    requests: Mapping[str, Mapping[str, RequestBlocks]],
    workers: Mapping[str, WorkerEpoch],
) -> dict[str, Any]:
    return {
        "workers": {worker_id: (worker.epoch, worker.alive) for worker_id, worker in workers.items()},
        "namespaces": {
            name: {
                "free": list(pool.free_blocks),
                "blocks": [
                    (b.ref_count, b.state.value, b.committed_slots, b.block_hash, b.token_ids) for b in pool.blocks
                ],
                "index": dict(pool.hash_to_block),
                "writers": sorted(pool.writers),
                "requests": {
                    request_id: (
                        state.holder,
                        tuple(state.block_table),
                        state.committed_len,
                        state.reserved_len,
                        tuple(state.block_hashes),
                        tuple(state.partial_token_ids),
                    )
                    for request_id, state in requests[name].items()
                },
            }
            for name, pool in pools.items()
        },
    }
