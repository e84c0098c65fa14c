"""kv_manager: the central KV-block manager (reserve -> commit -> rollback), plain-Python ledger + Ray actor.

Graph: scheduler's engine -> RemoteKV (cluster/serving/remote_backends.py) -> KVManagerActor (Ray, async)
       -> BlockLedger -> BlockPool per namespace; in process (`specserve generate`): LocalKV -> BlockLedger.
The ledger owns block ids, ref counts and block states; the workers own the tensors
([num_blocks, block_size, kv_heads, head_dim] per layer) and only follow the slot mappings.

How the engine uses it, per (namespace, request); the actor has the same calls, batched (add_requests /
reserve / commit / rollback / release take lists), and the engine reaches either through its `KVClient`
(cluster/engine/kv_client.py: `LocalKV` over a ledger, `RemoteKV` over the actor):

    holder = ledger.register_worker("verifier-0")                  # Holder(worker_id, epoch)
    if ledger.can_admit({ns: len(prompt) + k + 1}):                 # plan maximum; ExceedsCapacity: never
        adm = ledger.add_request(ns, rid, prompt_token_ids, holder) # adm.num_cached_tokens: prefix hit
    # every round, one batch call each (<= 2 RPCs per round through the actor):
    res = ledger.reserve([ReserveItem(ns, rid, num_new_slots, holder), ...])  # Reservation | KVError each
    #   atomic=True: the whole batch or nothing (raises the first refusal)
    #   prefill round: num_new_slots = len(prompt) - committed_len; decode round: k + 1 (or tree nodes)
    #   worker: run res.copy_on_write (src_block -> dst_block) first, then write KV at res.slot_mapping
    out = ledger.commit([CommitItem(ns, rid, accepted_len, token_ids, holder), ...])
    #   token_ids: the tokens of the accepted positions; the correction/bonus token is the next
    #   round's first input and gets its KV then; trees: accepted_path -> out.slot_moves to run
    #   attention reads res.block_table / out.block_table, always the latest one: a block filled with
    #   content identical to an indexed block is swapped for that shared block at commit
    ledger.release(ns, rid)                      # or CommitItem(..., finished=True); cancel: rollback/release
    ledger.fork(ns, rid, child_rid)              # n samples of one prompt
    ledger.block_table(ns, rid), ledger.committed_len(ns, rid), ledger.free_fraction(ns)
    ledger.audit().leaked_blocks, ledger.assert_no_leaks()

Slot layout (block_size 4; slot = block_id * block_size + offset; c committed, r reserved):

    position        0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13 14 15
    block_table     7          | 2          | 9          | 5            (5: new, from the free-list head)
    committed 11    c  c  c  c | c  c  c  c | c  c  c  .
    reserve 5       c  c  c  c | c  c  c  c | c  c  c  r | r  r  r  r
      slot_mapping = (9*4+3, 5*4+0, 5*4+1, 5*4+2, 5*4+3) = (39, 20, 21, 22, 23)
    commit 2        c  c  c  c | c  c  c  c | c  c  c  c | c  .  .  .   block 5 kept, 1 committed slot
    or commit 1     c  c  c  c | c  c  c  c | c  c  c  c                block 5 back to the free list
    (either way block 9 is now full: content-hashed and shareable)

Prefix sharing: full committed blocks are indexed by a chained content hash; `add_request` shares
the leading cached full blocks of the prompt, never the block holding the last prompt token.
`fork` shares every block, the partial last one included: the first write copies it (copy on write).
Holders: every grant is held by (request, worker, epoch); `expire_worker` drops the worker's
requests, and a late call from a dead epoch is refused with `StaleEpoch`.
KV is a cache, tokens are the truth: lost KV is recovered by re-admitting and re-prefilling.
"""

from __future__ import annotations

from typing import Any

from kv_manager.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    InvalidCommit,
    InvalidSize,
    KVError,
    OutOfBlocks,
    ReservationInFlight,
    RetriableKVError,
    StaleEpoch,
    UnknownNamespace,
    UnknownRequest,
)
from kv_manager.ledger import BlockLedger
from kv_manager.schema import (
    Admission,
    AdmitItem,
    AuditReport,
    BlockState,
    CommitItem,
    CommitResult,
    Holder,
    NamespaceConfig,
    NamespaceCounts,
    RequestKey,
    Reservation,
    ReserveItem,
)

_ACTOR_NAMES = ("KVManager", "KVManagerActor")

__all__ = [
    "Admission",
    "AdmitItem",
    "AuditReport",
    "BlockLedger",
    "BlockState",
    "CommitItem",
    "CommitResult",
    "DuplicateRequest",
    "ExceedsCapacity",
    "Holder",
    "InvalidCommit",
    "InvalidSize",
    "KVError",
    "NamespaceConfig",
    "NamespaceCounts",
    "OutOfBlocks",
    "RequestKey",
    "Reservation",
    "ReservationInFlight",
    "ReserveItem",
    "RetriableKVError",
    "StaleEpoch",
    "UnknownNamespace",
    "UnknownRequest",
    *_ACTOR_NAMES,
]


def __getattr__(name: str) -> Any:
    # the actor names import ray; load them only when asked, so `import kv_manager` stays ray-free
    if name in _ACTOR_NAMES:
        from kv_manager import actor

        return getattr(actor, name)
    raise AttributeError(f"module 'kv_manager' has no attribute {name!r}")
