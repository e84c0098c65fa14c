"""The ledger as its client last saw it answer: the input of a rebuild (kv_manager/rebuild.py).

A restarted KV manager starts with an empty ledger, but nothing the ledger held is lost: its only client (the
scheduler's engine, through `RemoteKV`) was told every grant and every commit, and the workers still hold the KV
behind them at those block ids. `LiveRecord` keeps what the answers said, per (namespace, request): the holder,
the block table, the committed and reserved lengths, and the committed tokens (the prefix index's hashes are made
from them). A call whose answer never came (the manager died during it) is not in the record: the rebuilt ledger is
the one before that call, so the call is simply sent again. Grants made by a lost answer were never used (no
worker wrote to them), so they are free again.

    engine -> RemoteKV -> call -> answer -> LiveRecord.<call>(items, outcomes)    every acknowledged change
    manager restarted:  RemoteKV -> actor.rebuild(record.state()) -> rebuild_ledger(namespaces, state)

Owner: the client's calling thread (the engine thread; a lock for the ahead call's thread on the Ray path).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kv_manager.errors import KVError
from kv_manager.schema import (
    Admission,
    AdmitItem,
    CommitItem,
    CommitResult,
    Holder,
    RequestKey,
    Reservation,
    ReserveItem,
)


@dataclass(frozen=True)
class LiveEntry:
    """One request's entry in one namespace as the ledger last answered: positions [0, committed_len) verified,
    the next reserved_len granted; `committed_tokens` are the tokens of the committed positions."""

    namespace: str
    request_id: str
    holder: Holder
    block_table: tuple[int, ...]
    committed_len: int
    reserved_len: int
    committed_tokens: tuple[int, ...]


@dataclass(frozen=True)
class LiveWorker:
    worker_id: str
    epoch: int
    alive: bool


@dataclass(frozen=True)
class LiveState:
    """Everything a rebuilt ledger needs besides its namespaces' sizes."""

    workers: tuple[LiveWorker, ...] = ()
    entries: tuple[LiveEntry, ...] = ()


@dataclass(slots=True)
class _Entry:
    holder: Holder
    block_table: list[int]
    committed_len: int
    reserved_len: int = 0
    committed_tokens: list[int] = field(default_factory=list)


class LiveRecord:
    """Every acknowledged change of the ledger, applied as its answer says (one method per ledger call).
    Refusals (a KVError in an answer) changed nothing in the ledger, and change nothing here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[RequestKey, _Entry] = {}
        self._workers: dict[str, LiveWorker] = {}

    # -- workers --------------------------------------------------------------------------------------
    def registered(self, holder: Holder) -> None:
        """A new epoch of the worker: the entries of its earlier epoch were dropped with it."""
        with self._lock:
            self._drop_worker(holder.worker_id)
            self._workers[holder.worker_id] = LiveWorker(holder.worker_id, holder.epoch, True)

    def expired(self, worker_id: str) -> None:
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is not None and worker.alive:
                self._workers[worker_id] = LiveWorker(worker_id, worker.epoch, False)
                self._drop_worker(worker_id)

    def _drop_worker(self, worker_id: str) -> None:
        for key in [key for key, entry in self._entries.items() if entry.holder.worker_id == worker_id]:
            del self._entries[key]

    # -- entries --------------------------------------------------------------------------------------
    def admitted(self, items: Sequence[AdmitItem], outcomes: Sequence[Admission | KVError]) -> None:
        with self._lock:
            for item, outcome in zip(items, outcomes, strict=True):
                if isinstance(outcome, Admission):
                    cached = outcome.num_cached_tokens
                    self._entries[item.namespace, item.request_id] = _Entry(
                        item.holder, list(outcome.block_table), cached, 0, list(item.prompt_token_ids[:cached]))

    def forked(self, items: Sequence[tuple[str, str, str]], outcomes: Sequence[Admission | KVError]) -> None:
        """(namespace, parent_id, child_id) each: the child holds the parent's blocks and tokens."""
        with self._lock:
            for (namespace, parent_id, child_id), outcome in zip(items, outcomes, strict=True):
                parent = self._entries.get((namespace, parent_id))
                if isinstance(outcome, Admission) and parent is not None:
                    self._entries[namespace, child_id] = _Entry(
                        parent.holder, list(outcome.block_table), outcome.num_cached_tokens, 0,
                        list(parent.committed_tokens))

    def reserved(self, items: Sequence[ReserveItem], outcomes: Sequence[Reservation | KVError]) -> None:
        with self._lock:
            for item, outcome in zip(items, outcomes, strict=True):
                entry = self._entries.get((item.namespace, item.request_id))
                if isinstance(outcome, Reservation) and entry is not None:
                    entry.block_table = list(outcome.block_table)
                    entry.reserved_len = len(outcome.slot_mapping)  # a window: the whole of it

    def committed(self, items: Sequence[CommitItem], outcomes: Sequence[CommitResult | KVError]) -> None:
        with self._lock:
            for item, outcome in zip(items, outcomes, strict=True):
                key = (item.namespace, item.request_id)
                entry = self._entries.get(key)
                if not isinstance(outcome, CommitResult) or entry is None:
                    continue
                if item.finished:
                    del self._entries[key]
                    continue
                reserved_end = entry.committed_len + entry.reserved_len
                entry.committed_tokens.extend(item.token_ids)
                entry.committed_len = outcome.committed_len
                entry.reserved_len = reserved_end - outcome.committed_len if item.keep_reserved else 0
                entry.block_table = list(outcome.block_table)

    def rolled_back(self, keys: Sequence[RequestKey], outcomes: Sequence[int | KVError]) -> None:
        """Each answer is the number of blocks freed: the table's last ones (the reservation's)."""
        with self._lock:
            for key, outcome in zip(keys, outcomes, strict=True):
                entry = self._entries.get(key)
                if isinstance(outcome, int) and entry is not None:
                    del entry.block_table[len(entry.block_table) - outcome:]
                    entry.reserved_len = 0

    def released(self, keys: Iterable[RequestKey]) -> None:
        """Entries that are gone (released, or unknown to the ledger already)."""
        with self._lock:
            for key in keys:
                self._entries.pop(key, None)

    # -- reading --------------------------------------------------------------------------------------
    def state(self) -> LiveState:
        with self._lock:
            return LiveState(
                tuple(self._workers.values()),
                tuple(LiveEntry(namespace, request_id, e.holder, tuple(e.block_table), e.committed_len,
                                e.reserved_len, tuple(e.committed_tokens))
                      for (namespace, request_id), e in self._entries.items()))

    def request_ids(self) -> Mapping[str, list[str]]:
        with self._lock:
            out: dict[str, list[str]] = {}
            for namespace, request_id in self._entries:
                out.setdefault(namespace, []).append(request_id)
            return out
