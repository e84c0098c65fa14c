"""One request's blocks in one namespace (`RequestBlocks`), and the block moves on its block table.

Invariant kept by every function here: the table covers exactly the request's positions,
len(block_table) == cdiv(committed_len + reserved_len, block_size); block i holds positions
[i * block_size, (i + 1) * block_size). These functions mutate; the ledger validates before calling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_manager.block_pool import ROOT_HASH, Block, BlockPool, hash_block
from kv_manager.schema import BlockState, Holder


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class RequestBlocks:
    request_id: str
    holder: Holder
    block_table: list[int] = field(default_factory=list)
    committed_len: int = 0
    reserved_len: int = 0
    block_hashes: list[int] = field(default_factory=list)  # one per full committed block
    partial_token_ids: list[int] = field(default_factory=list)  # tokens of the partial last block


def match_prefix(pool: BlockPool, prompt_token_ids: Sequence[int]) -> tuple[list[Block], list[int]]:
    """The prompt's leading cached full blocks and their hashes, never the block of its last token."""
    bs = pool.block_size
    hits: list[Block] = []
    hashes: list[int] = []
    parent = ROOT_HASH
    for index in range((len(prompt_token_ids) - 1) // bs):
        chunk = tuple(prompt_token_ids[index * bs : (index + 1) * bs])
        block_hash = hash_block(parent, chunk)
        block = pool.lookup(block_hash, chunk)
        if block is None:
            break
        hits.append(block)
        hashes.append(block_hash)
        parent = block_hash
    return hits, hashes


def slot_of(pool: BlockPool, state: RequestBlocks, position: int) -> int:
    bs = pool.block_size
    return state.block_table[position // bs] * bs + position % bs


def slot_mapping(pool: BlockPool, state: RequestBlocks, start: int, end: int) -> list[int]:
    """Slots of positions [start, end), one block segment at a time."""
    bs = pool.block_size
    table = state.block_table
    slots: list[int] = []
    position = start
    while position < end:
        offset = position % bs
        take = min(bs - offset, end - position)
        first = table[position // bs] * bs + offset
        slots.extend(range(first, first + take))
        position += take
    return slots


def needs_copy(pool: BlockPool, state: RequestBlocks) -> bool:
    """Would the next write land in a partial last block that another request shares (a fork)?"""
    return state.committed_len % pool.block_size != 0 and pool.blocks[state.block_table[-1]].ref_count > 1


def grow(pool: BlockPool, state: RequestBlocks, num_new_blocks: int, copy: bool) -> tuple[tuple[int, int], ...]:
    """Copy the partial last block if `copy` (it is shared: `needs_copy`), then append new blocks; returns the
    copies to run."""
    table = state.block_table
    copies: tuple[tuple[int, int], ...] = ()
    if copy:
        source = pool.blocks[table[-1]]
        assert source.ref_count > 1 and source.state is BlockState.COMMITTED, source
        copy = pool.allocate()
        copy.state = BlockState.COMMITTED
        copy.committed_slots = source.committed_slots
        pool.decref(source)
        table[-1] = copy.block_id
        copies = ((source.block_id, copy.block_id),)
    for _ in range(num_new_blocks):
        table.append(pool.allocate().block_id)
    return copies


def mark_committed(pool: BlockPool, state: RequestBlocks, new_len: int) -> None:
    """Positions [committed_len, new_len) hold verified KV now (the table covers them; a reservation window's
    positions past new_len keep their reserved blocks)."""
    bs = pool.block_size
    for index in range(state.committed_len // bs, cdiv(new_len, bs)):  # a window's blocks past it stay reserved
        block = pool.blocks[state.block_table[index]]
        assert block.ref_count == 1 and block.state is not BlockState.FREE, block
        block.committed_slots = min(bs, new_len - index * bs)
        block.state = BlockState.COMMITTED
    state.committed_len = new_len


def truncate(pool: BlockPool, state: RequestBlocks, keep_len: int) -> int:
    """End the reservation and free the blocks past `keep_len` positions (reserved-only, unshared)."""
    keep_blocks = cdiv(keep_len, pool.block_size)
    table = state.block_table
    for block_id in reversed(table[keep_blocks:]):
        block = pool.blocks[block_id]
        assert block.ref_count == 1 and block.state is BlockState.RESERVED, block
        pool.decref(block)
    num_freed = len(table) - keep_blocks
    del table[keep_blocks:]
    state.reserved_len = 0
    return num_freed


def index_full_blocks(pool: BlockPool, state: RequestBlocks, token_ids: Sequence[int]) -> int:
    """Hash the blocks a commit filled; one identical to an indexed block is swapped for it (freed)."""
    bs = pool.block_size
    tokens = state.partial_token_ids + list(token_ids)
    num_full = len(tokens) // bs
    num_freed = 0
    for chunk_index in range(num_full):
        chunk = tuple(tokens[chunk_index * bs : (chunk_index + 1) * bs])
        index = len(state.block_hashes)
        block_hash = hash_block(state.block_hashes[-1] if index else ROOT_HASH, chunk)
        state.block_hashes.append(block_hash)
        block = pool.blocks[state.block_table[index]]
        twin = pool.lookup(block_hash, chunk)
        if twin is None:
            pool.register_full(block, block_hash, chunk)
        elif twin is not block:
            pool.take_shared(twin)
            state.block_table[index] = twin.block_id
            num_freed += pool.decref(block, keep_content=False)
    state.partial_token_ids = tokens[num_full * bs :]
    return num_freed


def release_blocks(pool: BlockPool, state: RequestBlocks, *, keep_content: bool) -> int:
    """Drop every hold of the request, last block first; returns how many blocks became free."""
    num_freed = 0
    for block_id in reversed(state.block_table):
        num_freed += pool.decref(pool.blocks[block_id], keep_content=keep_content)
    state.block_table.clear()
    state.reserved_len = 0
    return num_freed
