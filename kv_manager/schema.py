"""Value types (schema) of the KV-block ledger: configs, batch items, results, the audit report.

All are plain, picklable dataclasses (they cross the Ray actor boundary). Positions are 0-based
token positions of one request's sequence; a slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_manager.errors import InvalidSize

RequestKey = tuple[str, str]  # (namespace, request_id)


class BlockState(enum.Enum):
    FREE = "free"  # ref_count 0, on the free list (may still carry cached content)
    RESERVED = "reserved"  # held by one request, holds speculative slots only
    COMMITTED = "committed"  # held by >= 1 request, holds >= 1 verified token's KV


@dataclass(frozen=True)
class NamespaceConfig:
    """One paged KV pool of one model role, e.g. name="verifier/target" or "drafter/draft"."""

    name: str
    num_blocks: int
    block_size: int
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidSize("namespace name must be non-empty")
        if self.num_blocks <= 0:
            raise InvalidSize(f"num_blocks must be > 0, got {self.num_blocks}", namespace=self.name)
        if self.block_size <= 0:
            raise InvalidSize(f"block_size must be > 0, got {self.block_size}", namespace=self.name)


@dataclass(frozen=True)
class Holder:
    """Who holds a grant: a worker in one epoch. A worker's restart starts a new epoch."""

    worker_id: str
    epoch: int


@dataclass(frozen=True)
class AdmitItem:
    namespace: str
    request_id: str
    prompt_token_ids: Sequence[int]
    holder: Holder


@dataclass(frozen=True)
class Admission:
    """A request's entry: the first `num_cached_tokens` prompt tokens already have KV (shared)."""

    namespace: str
    request_id: str
    num_cached_tokens: int
    block_table: tuple[int, ...]


@dataclass(frozen=True)
class ReserveItem:
    """Reserve `num_new_slots` positions starting at the request's committed_len.

    `extend=True` grows the reservation in flight (a reservation window, kept by `keep_reserved` commits) to
    `num_new_slots` positions from committed_len, or leaves it as it is if it is that long; a request with none
    in flight reserves as usual. The grant covers the whole window."""

    namespace: str
    request_id: str
    num_new_slots: int
    holder: Holder
    extend: bool = False


@dataclass(frozen=True)
class Reservation:
    """A grant. Run `copy_on_write` (src_block -> dst_block, whole blocks) before writing."""

    namespace: str
    request_id: str
    start_pos: int
    slot_mapping: tuple[int, ...]  # one slot per new position start_pos, start_pos + 1, ...
    block_table: tuple[int, ...]
    copy_on_write: tuple[tuple[int, int], ...]
    block_size: int

    def block_offsets(self) -> list[tuple[int, int]]:
        """The slot mapping as (block_id, offset) pairs."""
        return [divmod(slot, self.block_size) for slot in self.slot_mapping]


@dataclass(frozen=True)
class CommitItem:
    """Keep the first `accepted_len` reserved positions; `token_ids` are their tokens.

    For a tree reservation, `accepted_path` lists the reserved offsets (0-based, increasing) of
    the accepted nodes; the result's `slot_moves` compact them to the front of the reservation.
    `finished=True` releases the request right after the commit (one RPC instead of two).
    `keep_reserved=True` keeps the reserved positions past the accepted ones reserved (the request's reservation
    window: the next round's slots, already granted); without it they return to the pool.
    """

    namespace: str
    request_id: str
    accepted_len: int
    token_ids: Sequence[int]
    holder: Holder
    accepted_path: Sequence[int] | None = None
    finished: bool = False
    keep_reserved: bool = False


@dataclass(frozen=True)
class CommitResult:
    namespace: str
    request_id: str
    committed_len: int
    block_table: tuple[int, ...]  # may differ from the reservation's: identical full blocks dedupe
    slot_moves: tuple[tuple[int, int], ...] = ()  # (src_slot, dst_slot), run in order
    num_freed_blocks: int = 0


@dataclass(frozen=True)
class NamespaceCounts:
    capacity: int
    free: int
    reserved: int
    committed: int
    cached: int  # free blocks whose content is still reusable by a prefix hit

    @property
    def free_fraction(self) -> float:
        return self.free / self.capacity


@dataclass(frozen=True)
class AuditReport:
    counts: dict[str, NamespaceCounts]
    leaked_blocks: tuple[tuple[str, int], ...] = ()  # (namespace, block_id) held by no live request
    errors: tuple[str, ...] = field(default=())  # broken invariants

    @property
    def ok(self) -> bool:
        return not self.leaked_blocks and not self.errors

    def assert_no_leaks(self) -> None:
        if not self.ok:
            raise AssertionError(f"KV ledger audit failed: leaked={list(self.leaked_blocks)} errors={list(self.errors)}")


@dataclass(slots=True)
class WorkerEpoch:
    epoch: int
    alive: bool
