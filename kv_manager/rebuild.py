"""A ledger rebuilt from the live state its client recorded (kv_manager/live_state.py): a pure function.

    rebuild_ledger(namespaces, LiveState, first_epoch) -> BlockLedger

Each live entry gets back its block table, committed and reserved lengths and holder; each block held by a table
gets back its reference count (the tables holding it: a fork's shared blocks, a prefix hit's), its state and its
committed slots (committed where some table's committed positions reach into it, reserved otherwise); full
committed blocks of a prefix-caching namespace get back their chained content hashes (made from the committed
tokens, as `index_full_blocks` made them) and their place in the prefix index. Every other block is free, without
cached content. Workers keep their epochs, so the holders the engine uses stay live, and a later registration
starts a new epoch above them.

The same block ids as before: the workers' KV at those blocks is still right, so no request re-prefills. The state
is checked first, a contradiction raises InconsistentLiveState and builds nothing: a block claimed by two tables
with different committed slots, a reserved block shared, a table that does not cover its positions, a block id
outside the namespace, committed tokens that do not match the committed length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kv_manager.block_pool import ROOT_HASH, BlockPool, hash_block
from kv_manager.errors import InconsistentLiveState
from kv_manager.ledger import BlockLedger
from kv_manager.live_state import LiveEntry, LiveState
from kv_manager.request_blocks import RequestBlocks, cdiv
from kv_manager.schema import BlockState, NamespaceConfig, WorkerEpoch


@dataclass(frozen=True)
class _Claim:
    """What one table says of one block: its committed slots, the hash and tokens it holds if full."""

    committed_slots: int
    block_hash: int | None
    token_ids: tuple[int, ...]


def rebuild_ledger(namespaces: Iterable[NamespaceConfig], live: LiveState, *, first_epoch: int = 0) -> BlockLedger:
    ledger = BlockLedger(namespaces, first_epoch=first_epoch)
    unknown = {e.namespace for e in live.entries} - set(ledger.pools)
    if unknown:
        raise InconsistentLiveState(f"entries in unknown namespaces {sorted(unknown)}")
    states = {name: _entries(ledger.pools[name], [e for e in live.entries if e.namespace == name])
              for name in ledger.pools}
    for name, (requests, claims) in states.items():
        _apply(ledger.pools[name], claims)
        ledger.requests[name] = requests
        ledger.pools[name].writers.update(state.holder.worker_id for state in requests.values())
    for worker in live.workers:
        ledger.workers[worker.worker_id] = WorkerEpoch(worker.epoch, worker.alive)
    for entries in states.values():
        for state in entries[0].values():
            if not ledger.is_live(state.holder):
                raise InconsistentLiveState(f"{state.request_id} is held by {state.holder}, not a live epoch",
                                            request_id=state.request_id)
    return ledger


def _entries(pool: BlockPool, entries: list[LiveEntry]
             ) -> tuple[dict[str, RequestBlocks], dict[int, list[_Claim]]]:
    """Each entry as the ledger keeps it, and each block's claims by the tables holding it."""
    requests: dict[str, RequestBlocks] = {}
    claims: dict[int, list[_Claim]] = {}
    for entry in entries:
        where = {"namespace": pool.name, "request_id": entry.request_id}
        if entry.request_id in requests:
            raise InconsistentLiveState("the entry appears twice", **where)
        _check_entry(pool, entry)
        state = RequestBlocks(entry.request_id, entry.holder, list(entry.block_table), entry.committed_len,
                              entry.reserved_len)
        bs = pool.block_size
        num_full = entry.committed_len // bs
        hashes: list[int] = []
        parent = ROOT_HASH
        for index, block_id in enumerate(entry.block_table):
            committed_slots = max(0, min(bs, entry.committed_len - index * bs))
            block_hash, tokens = None, ()
            if pool.config.prefix_caching and index < num_full:
                tokens = entry.committed_tokens[index * bs:(index + 1) * bs]
                block_hash = parent = hash_block(parent, tokens)
                hashes.append(block_hash)
            claims.setdefault(block_id, []).append(_Claim(committed_slots, block_hash, tokens))
        if pool.config.prefix_caching:
            state.block_hashes = hashes
            state.partial_token_ids = list(entry.committed_tokens[num_full * bs:])
        requests[entry.request_id] = state
    return requests, claims


def _check_entry(pool: BlockPool, entry: LiveEntry) -> None:
    where = {"namespace": pool.name, "request_id": entry.request_id}
    table = entry.block_table
    if entry.committed_len < 0 or entry.reserved_len < 0:
        raise InconsistentLiveState(f"negative lengths {entry.committed_len}, {entry.reserved_len}", **where)
    if len(table) != cdiv(entry.committed_len + entry.reserved_len, pool.block_size):
        raise InconsistentLiveState(f"{len(table)} blocks for {entry.committed_len} + {entry.reserved_len} "
                                    "positions", **where)
    if len(set(table)) != len(table) or any(not 0 <= b < pool.num_blocks for b in table):
        raise InconsistentLiveState(f"block table {list(table)} repeats a block or leaves the namespace", **where)
    if pool.config.prefix_caching and len(entry.committed_tokens) != entry.committed_len:
        raise InconsistentLiveState(f"{len(entry.committed_tokens)} committed tokens for committed_len "
                                    f"{entry.committed_len}", **where)


def _apply(pool: BlockPool, claims: dict[int, list[_Claim]]) -> None:
    """Take every claimed block out of the free list with its holders' count, state, slots and hash."""
    for block_id in sorted(claims):
        said = claims[block_id]
        first = said[0]
        if any(c.committed_slots != first.committed_slots for c in said):
            raise InconsistentLiveState(f"block {block_id} held with different committed slots "
                                        f"{[c.committed_slots for c in said]}", namespace=pool.name)
        if len(said) > 1 and first.committed_slots == 0:
            raise InconsistentLiveState(f"reserved block {block_id} held by {len(said)} tables", namespace=pool.name)
        if len({(c.block_hash, c.token_ids) for c in said}) > 1:
            raise InconsistentLiveState(f"block {block_id} holds different tokens in its tables", namespace=pool.name)
        block = pool.blocks[block_id]
        del pool.free_blocks[block_id]
        block.ref_count = len(said)
        block.committed_slots = first.committed_slots
        block.state = BlockState.COMMITTED if first.committed_slots else BlockState.RESERVED
        if first.block_hash is not None:
            block.block_hash = first.block_hash
            block.token_ids = first.token_ids
            pool.hash_to_block.setdefault(first.block_hash, block_id)
