"""The block ledger: who holds which KV block, per namespace, with reserve -> commit -> rollback.

Glossary:
  namespace      one paged KV pool of one model role ("verifier/target", "drafter/draft"); its
                 block ids mean nothing in another namespace
  committed_len  tokens of a request whose KV is final (verified); positions [0, committed_len)
  reservation    slots granted for one round at positions [committed_len, committed_len + n),
                 for the plan's maximum (k+1 target slots, or every tree node)
  window         a reservation kept across commits (`keep_reserved`) and grown (`extend`): the next
                 round's slots granted while this round verifies (docs/ARCHITECTURE.md §4)
  accepted_len   how many leading reserved positions the round keeps; the rest return at commit
  holder         (worker, epoch) holding a request's blocks; a dead epoch's grants are rolled back

Every public mutation checks first and acts after: a call that raises a `KVError` changed nothing.
One owner, one thread: the ledger is not locked; the actor (kv_manager.actor) serializes callers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_manager.audit import audit_ledger, snapshot_ledger
from kv_manager.block_pool import BlockPool
from kv_manager.errors import (
    DuplicateRequest,
    ExceedsCapacity,
    InvalidCommit,
    InvalidSize,
    KVError,
    OutOfBlocks,
    ReservationInFlight,
    StaleEpoch,
    UnknownNamespace,
    UnknownRequest,
)
from kv_manager.request_blocks import (
    RequestBlocks,
    cdiv,
    grow,
    index_full_blocks,
    mark_committed,
    match_prefix,
    needs_copy,
    release_blocks,
    slot_mapping,
    slot_of,
    truncate,
)
from kv_manager.schema import (
    Admission,
    AuditReport,
    CommitItem,
    CommitResult,
    Holder,
    NamespaceConfig,
    Reservation,
    ReserveItem,
    WorkerEpoch,
)


@dataclass(slots=True)
class _ReservePlan:
    pool: BlockPool
    state: RequestBlocks
    num_new_slots: int
    num_new_blocks: int
    copy_on_write: bool

    @property
    def blocks_needed(self) -> int:
        return self.num_new_blocks + self.copy_on_write


class BlockLedger:
    def __init__(self, namespaces: Iterable[NamespaceConfig], *, first_epoch: int = 0) -> None:
        self.first_epoch = first_epoch  # a restarted manager passes a larger one: epochs never repeat
        self.pools: dict[str, BlockPool] = {}
        self.requests: dict[str, dict[str, RequestBlocks]] = {}
        self.workers: dict[str, WorkerEpoch] = {}
        for config in namespaces:
            if config.name in self.pools:
                raise InvalidSize(f"duplicate namespace {config.name!r}", namespace=config.name)
            self.pools[config.name] = BlockPool(config)
            self.requests[config.name] = {}
        if not self.pools:
            raise InvalidSize("a ledger needs at least one namespace")

    # ---- workers and epochs -------------------------------------------------------------

    def register_worker(self, worker_id: str) -> Holder:
        """Start a new epoch of `worker_id` (a re-registration means it restarted: the old epoch dies)."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.alive:
            self.expire_worker(worker_id)
        epoch = self.first_epoch if worker is None else worker.epoch + 1
        self.workers[worker_id] = WorkerEpoch(epoch, alive=True)
        return Holder(worker_id, epoch)

    def expire_worker(self, worker_id: str) -> int:
        """The worker's current epoch is dead: drop every request it holds; returns how many."""
        worker = self.workers.get(worker_id)
        if worker is None or not worker.alive:
            return 0
        worker.alive = False
        dropped = 0
        for name, pool in self.pools.items():
            held = [state for state in self.requests[name].values() if state.holder.worker_id == worker_id]
            for state in held:
                self._drop(pool, state, keep_content=False)
            dropped += len(held)
            if worker_id in pool.writers:
                pool.writers.discard(worker_id)
                pool.forget_free_content()
        return dropped

    def is_live(self, holder: Holder) -> bool:
        worker = self.workers.get(holder.worker_id)
        return worker is not None and worker.alive and worker.epoch == holder.epoch

    # ---- admission ----------------------------------------------------------------------

    def free_fraction(self, namespace: str) -> float:
        pool = self._pool(namespace)
        return pool.num_free / pool.num_blocks

    def can_admit(self, plan: Mapping[str, int]) -> bool:
        """Would a new request needing `plan[namespace]` slots (its maximum) fit now in every namespace?

        Raises ExceedsCapacity for a plan that could never fit, InvalidSize for a negative one.
        """
        fits = True
        for namespace, num_slots in plan.items():
            pool = self._pool(namespace)
            if num_slots < 0:
                raise InvalidSize(f"negative slot count {num_slots}", namespace=namespace)
            num_blocks = cdiv(num_slots, pool.block_size)
            if num_blocks > pool.num_blocks:
                raise ExceedsCapacity(
                    f"plan needs {num_blocks} blocks, namespace has {pool.num_blocks}", namespace=namespace
                )
            fits = fits and num_blocks <= pool.num_free
        return fits

    def add_request(
        self, namespace: str, request_id: str, prompt_token_ids: Sequence[int], holder: Holder
    ) -> Admission:
        """Admit a request; its leading full prompt blocks already cached are shared, never the
        block holding the last prompt token (the engine needs that token's logits)."""
        pool = self._pool(namespace)
        self._check_live(holder, namespace, request_id)
        if request_id in self.requests[namespace]:
            raise DuplicateRequest(f"request {request_id!r} is already live", namespace=namespace, request_id=request_id)
        prompt_len = len(prompt_token_ids)
        if prompt_len == 0:
            raise InvalidSize("empty prompt", namespace=namespace, request_id=request_id)
        if cdiv(prompt_len, pool.block_size) > pool.num_blocks:
            raise ExceedsCapacity(
                f"prompt of {prompt_len} tokens exceeds the namespace", namespace=namespace, request_id=request_id
            )
        state = RequestBlocks(request_id, holder)
        if pool.config.prefix_caching:
            hits, state.block_hashes = match_prefix(pool, prompt_token_ids)
            for block in hits:
                pool.take_shared(block)
                state.block_table.append(block.block_id)
            state.committed_len = len(hits) * pool.block_size
        pool.writers.add(holder.worker_id)
        self.requests[namespace][request_id] = state
        return Admission(namespace, request_id, state.committed_len, tuple(state.block_table))

    def fork(self, namespace: str, parent_id: str, child_id: str) -> Admission:
        """A child sharing every block of the parent (n samples of one prompt); writes copy on write."""
        pool, parent = self._lookup(namespace, parent_id, None)
        if child_id in self.requests[namespace]:
            raise DuplicateRequest(f"request {child_id!r} is already live", namespace=namespace, request_id=child_id)
        if parent.reserved_len:
            raise ReservationInFlight("cannot fork during a reservation", namespace=namespace, request_id=parent_id)
        for block_id in parent.block_table:
            pool.incref(pool.blocks[block_id])
        child = RequestBlocks(
            child_id,
            parent.holder,
            list(parent.block_table),
            parent.committed_len,
            0,
            list(parent.block_hashes),
            list(parent.partial_token_ids),
        )
        self.requests[namespace][child_id] = child
        return Admission(namespace, child_id, child.committed_len, tuple(child.block_table))

    # ---- rounds -------------------------------------------------------------------------

    def reserve(self, items: Sequence[ReserveItem], *, atomic: bool = False) -> list[Reservation | KVError]:
        """One round's grants, all-or-nothing per request (per batch with `atomic=True`, which
        raises the first refusal instead). Slot layout of one request, block_size 4:

            committed_len = 6, num_new_slots = 5 (k = 4 drafts + 1)
            position   0  1  2  3 | 4  5  6  7 | 8  9 10 11
            block      table[0]=7 | table[1]=2 | table[2]=9   (new: allocated from the free-list head)
            state      c  c  c  c | c  c  r  r | r  r  r  .    c committed, r reserved
            slot_mapping = (2*4+2, 2*4+3, 9*4+0, 9*4+1, 9*4+2) = (10, 11, 36, 37, 38)

        Had table[1] been shared (a fork), it is first copied: copy_on_write=((2, new),).
        """
        if not atomic:
            outcomes: list[Reservation | KVError] = []
            for item in items:
                try:
                    outcomes.append(self._apply_reserve(self._plan_reserve(item, 0)))
                except KVError as refusal:
                    outcomes.append(refusal)
            return outcomes
        keys = {(item.namespace, item.request_id) for item in items}
        if len(keys) != len(items):
            raise InvalidSize("an atomic batch names a request twice")
        demand: dict[str, int] = {}
        plans = []
        for item in items:
            plan = self._plan_reserve(item, demand.get(item.namespace, 0))
            demand[item.namespace] = demand.get(item.namespace, 0) + plan.blocks_needed
            plans.append(plan)
        return [self._apply_reserve(plan) for plan in plans]

    def reserve_one(self, item: ReserveItem) -> Reservation:
        return self._apply_reserve(self._plan_reserve(item, 0))

    def commit(self, items: Sequence[CommitItem]) -> list[CommitResult | KVError]:
        """One round's commits; each item succeeds or is refused (returned) on its own."""
        outcomes: list[CommitResult | KVError] = []
        for item in items:
            try:
                outcomes.append(self.commit_one(item))
            except KVError as refusal:
                outcomes.append(refusal)
        return outcomes

    def commit_one(self, item: CommitItem) -> CommitResult:
        pool, state = self._check_commit(item)
        start = state.committed_len
        slot_moves: tuple[tuple[int, int], ...] = ()
        if item.accepted_path is not None:
            slot_moves = tuple(
                (slot_of(pool, state, start + src), slot_of(pool, state, start + dst))
                for dst, src in enumerate(item.accepted_path)
                if src != dst
            )
        reserved_end = start + state.reserved_len
        num_freed = 0 if item.keep_reserved else truncate(pool, state, start + item.accepted_len)
        if item.accepted_len:
            mark_committed(pool, state, start + item.accepted_len)
            if pool.config.prefix_caching:
                num_freed += index_full_blocks(pool, state, item.token_ids)
        if item.keep_reserved:
            state.reserved_len = reserved_end - state.committed_len
        result = CommitResult(
            item.namespace, item.request_id, state.committed_len, tuple(state.block_table), slot_moves, num_freed
        )
        if item.finished:
            self._drop(pool, state, keep_content=True)
        return result

    def rollback(self, namespace: str, request_id: str, holder: Holder | None = None) -> int:
        """Return the in-flight reservation (if any); returns the number of blocks freed."""
        pool, state = self._lookup(namespace, request_id, holder)
        return truncate(pool, state, state.committed_len)

    def release(self, namespace: str, request_id: str, holder: Holder | None = None) -> int:
        """End a request: drop its reservation and its holds; returns the number of blocks freed."""
        pool, state = self._lookup(namespace, request_id, holder)
        return self._drop(pool, state, keep_content=True)

    # ---- getters and audit --------------------------------------------------------------

    def block_table(self, namespace: str, request_id: str) -> tuple[int, ...]:
        return tuple(self._lookup(namespace, request_id, None)[1].block_table)

    def committed_len(self, namespace: str, request_id: str) -> int:
        return self._lookup(namespace, request_id, None)[1].committed_len

    def reserved_len(self, namespace: str, request_id: str) -> int:
        return self._lookup(namespace, request_id, None)[1].reserved_len

    def request_ids(self, namespace: str) -> list[str]:
        self._pool(namespace)
        return list(self.requests[namespace])

    def audit(self) -> AuditReport:
        return audit_ledger(self.pools, self.requests)

    def assert_no_leaks(self) -> None:
        self.audit().assert_no_leaks()

    def snapshot(self) -> dict[str, Any]:
        """Plain, comparable copy of the whole state (tests compare it before and after a refusal)."""
        return snapshot_ledger(self.pools, self.requests, self.workers)

    # ---- internals ----------------------------------------------------------------------

    def _pool(self, namespace: str) -> BlockPool:
        pool = self.pools.get(namespace)
        if pool is None:
            raise UnknownNamespace(f"unknown namespace {namespace!r}", namespace=namespace)
        return pool

    def _check_live(self, holder: Holder, namespace: str, request_id: str) -> None:
        if not self.is_live(holder):
            raise StaleEpoch(f"holder {holder} is not a live epoch", namespace=namespace, request_id=request_id)

    def _lookup(self, namespace: str, request_id: str, holder: Holder | None) -> tuple[BlockPool, RequestBlocks]:
        pool = self._pool(namespace)
        if holder is not None:
            self._check_live(holder, namespace, request_id)
        state = self.requests[namespace].get(request_id)
        if state is None:
            raise UnknownRequest(f"unknown request {request_id!r}", namespace=namespace, request_id=request_id)
        if holder is not None and state.holder != holder:
            raise StaleEpoch(
                f"request is held by {state.holder}, not {holder}", namespace=namespace, request_id=request_id
            )
        return pool, state

    def _plan_reserve(self, item: ReserveItem, blocks_promised: int) -> _ReservePlan:
        pool, state = self._lookup(item.namespace, item.request_id, item.holder)
        if item.num_new_slots <= 0:
            raise InvalidSize(
                f"num_new_slots must be > 0, got {item.num_new_slots}",
                namespace=item.namespace,
                request_id=item.request_id,
            )
        if state.reserved_len and not item.extend:
            raise ReservationInFlight(
                "commit or roll back the previous reservation first",
                namespace=item.namespace,
                request_id=item.request_id,
            )
        bs = pool.block_size
        start = state.committed_len
        num_slots = max(item.num_new_slots, state.reserved_len)  # an extend never shrinks a window
        total_blocks = cdiv(start + num_slots, bs)
        if total_blocks > pool.num_blocks:
            raise ExceedsCapacity(
                f"{total_blocks} blocks exceed the namespace's {pool.num_blocks}",
                namespace=item.namespace,
                request_id=item.request_id,
            )
        table = state.block_table
        assert len(table) == cdiv(start + state.reserved_len, bs), (len(table), start, state.reserved_len)
        # in an atomic batch of fork siblings this may count a copy that a sibling's copy makes needless; a window
        # in flight was copied when it was first reserved
        copy = not state.reserved_len and needs_copy(pool, state)
        plan = _ReservePlan(pool, state, num_slots, total_blocks - len(table), copy)
        if plan.blocks_needed + blocks_promised > pool.num_free:
            raise OutOfBlocks(
                f"needs {plan.blocks_needed} blocks, {pool.num_free - blocks_promised} free",
                namespace=item.namespace,
                request_id=item.request_id,
            )
        return plan

    def _apply_reserve(self, plan: _ReservePlan) -> Reservation:
        pool, state = plan.pool, plan.state
        # a fork sibling's copy earlier in an atomic batch may have made this one's needless
        copies = grow(pool, state, plan.num_new_blocks, plan.copy_on_write and needs_copy(pool, state))
        start = state.committed_len
        slots = slot_mapping(pool, state, start, start + plan.num_new_slots)
        state.reserved_len = plan.num_new_slots
        return Reservation(
            pool.name, state.request_id, start, tuple(slots), tuple(state.block_table), copies, pool.block_size
        )

    def _check_commit(self, item: CommitItem) -> tuple[BlockPool, RequestBlocks]:
        pool, state = self._lookup(item.namespace, item.request_id, item.holder)
        where = {"namespace": item.namespace, "request_id": item.request_id}
        if item.accepted_len < 0:
            raise InvalidSize(f"accepted_len must be >= 0, got {item.accepted_len}", **where)
        if not state.reserved_len:
            raise InvalidCommit("no reservation in flight (double commit?)", **where)
        if item.accepted_len > state.reserved_len:
            raise InvalidCommit(f"accepted_len {item.accepted_len} > reserved {state.reserved_len}", **where)
        if len(item.token_ids) != item.accepted_len:
            raise InvalidCommit(f"{len(item.token_ids)} token ids for accepted_len {item.accepted_len}", **where)
        path = item.accepted_path
        if path is not None:
            if len(path) != item.accepted_len:
                raise InvalidCommit(f"accepted_path has {len(path)} nodes, accepted_len {item.accepted_len}", **where)
            if any(not 0 <= offset < state.reserved_len for offset in path) or any(
                a >= b for a, b in zip(path, path[1:], strict=False)
            ):
                raise InvalidCommit(f"accepted_path {list(path)} is not increasing within the reservation", **where)
        return pool, state

    def _drop(self, pool: BlockPool, state: RequestBlocks, *, keep_content: bool) -> int:
        num_freed = release_blocks(pool, state, keep_content=keep_content)
        del self.requests[pool.name][state.request_id]
        return num_freed
