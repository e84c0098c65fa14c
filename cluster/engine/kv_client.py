"""The engine's view of the KV-block manager: the `KVClient` protocol, and `LocalKV`, its in-process
implementation over a `BlockLedger`. The other implementations: `RemoteKV` (the Ray actor's client,
cluster/serving/remote_backends.py) and the engine's own wrapper `HeldCommitKV` (held_commit.py).
Each round makes one `reserve` and one `commit` call for the whole batch, or with reservation windows one
`commit_then_reserve_ahead` beside the verify (docs/ARCHITECTURE.md §4).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Protocol

from kv_manager.errors import KVError, UnknownRequest
from kv_manager.ledger import BlockLedger
from kv_manager.schema import (
    Admission,
    AdmitItem,
    AuditReport,
    CommitItem,
    CommitResult,
    Holder,
    Reservation,
    ReserveItem,
)

ForkItem = tuple[str, str, str]  # (namespace, parent_id, child_id)


class PendingRound(Protocol):
    """A `commit_then_reserve_ahead` on its way: `result()` waits for its answer (raises what the call raised)."""

    def result(self) -> tuple[list[CommitResult | KVError], list[Reservation | KVError]]: ...


class KVClient(Protocol):
    """What the engine asks of the KV-block manager. Batch calls answer per item (a grant or the
    KVError refusing it); `admit` is all or nothing and raises the first refusal."""

    def register_worker(self, worker_id: str) -> Holder: ...

    def expire_worker(self, worker_id: str) -> int: ...

    def can_admit(self, items: Sequence[AdmitItem], lookahead: int) -> bool: ...

    def admit(self, items: Sequence[AdmitItem]) -> list[Admission]: ...

    def fork(self, items: Sequence[ForkItem]) -> list[Admission]:
        """(namespace, parent_id, child_id) each: the child shares every block of the parent (copy on write);
        all or nothing, raises the first refusal."""
        ...

    def reserve(self, items: Sequence[ReserveItem]) -> list[Reservation | KVError]: ...

    def commit(self, items: Sequence[CommitItem]) -> list[CommitResult | KVError]: ...

    def commit_then_reserve(self, commits: Sequence[CommitItem], reserves: Sequence[ReserveItem]
                            ) -> tuple[list[CommitResult | KVError], list[Reservation | KVError]]: ...

    def commit_then_reserve_ahead(self, commits: Sequence[CommitItem], reserves: Sequence[ReserveItem]
                                  ) -> PendingRound:
        """`commit_then_reserve` on a call that runs while the caller goes on (beside the verify); the future
        raises what the call raised."""
        ...

    def rollback(self, keys: Sequence[tuple[str, str]]) -> None: ...

    def release(self, request_id: str, namespaces: Sequence[str]) -> None: ...

    def free_fraction(self, namespace: str) -> float: ...

    def request_ids(self, namespace: str) -> list[str]: ...

    def audit(self) -> AuditReport: ...

    def ledger_lost(self) -> bool:
        """True once the ledger this client talks to is gone (its actor restarted empty, or died)."""
        ...


class LocalKV:
    """Owner of nothing: forwards to the ledger, which owns all block state. Called from the engine thread
    only (with overlap too: the draft thread makes no ledger call), so it takes no lock."""

    def __init__(self, ledger: BlockLedger) -> None:
        self.ledger = ledger

    def register_worker(self, worker_id: str) -> Holder:
        return self.ledger.register_worker(worker_id)

    def expire_worker(self, worker_id: str) -> int:
        return self.ledger.expire_worker(worker_id)

    def can_admit(self, items: Sequence[AdmitItem], lookahead: int) -> bool:
        return self.ledger.can_admit({i.namespace: len(i.prompt_token_ids) + lookahead for i in items})

    def admit(self, items: Sequence[AdmitItem]) -> list[Admission]:
        return self._all_or_nothing(self.ledger.add_request(i.namespace, i.request_id, i.prompt_token_ids, i.holder)
                                    for i in items)

    def fork(self, items: Sequence[ForkItem]) -> list[Admission]:
        return self._all_or_nothing(self.ledger.fork(*item) for item in items)

    def _all_or_nothing(self, entries: Iterator[Admission]) -> list[Admission]:
        """Make every entry (`entries` makes them as it is iterated), or none: a refusal releases the entries
        already made and raises."""
        done: list[Admission] = []
        try:
            for entry in entries:
                done.append(entry)
        except KVError:
            for adm in done:
                self.ledger.release(adm.namespace, adm.request_id)
            raise
        return done

    def reserve(self, items: Sequence[ReserveItem]) -> list[Reservation | KVError]:
        return self.ledger.reserve(items)

    def commit(self, items: Sequence[CommitItem]) -> list[CommitResult | KVError]:
        return self.ledger.commit(items)

    def commit_then_reserve(self, commits: Sequence[CommitItem], reserves: Sequence[ReserveItem]
                            ) -> tuple[list[CommitResult | KVError], list[Reservation | KVError]]:
        """A deferred commit and the next reserve as one step (one round trip for the remote client)."""
        return self.ledger.commit(commits), self.ledger.reserve(reserves)

    def commit_then_reserve_ahead(self, commits: Sequence[CommitItem], reserves: Sequence[ReserveItem]
                                  ) -> Future[tuple[list[CommitResult | KVError], list[Reservation | KVError]]]:
        """Done at once: the ledger is in this process, a call costs microseconds."""
        done: Future[tuple[list[CommitResult | KVError], list[Reservation | KVError]]] = Future()
        done.set_result(self.commit_then_reserve(commits, reserves))
        return done

    def rollback(self, keys: Sequence[tuple[str, str]]) -> None:
        for namespace, request_id in keys:
            try:
                self.ledger.rollback(namespace, request_id)
            except UnknownRequest:
                pass

    def release(self, request_id: str, namespaces: Sequence[str]) -> None:
        for namespace in namespaces:
            if request_id in self.ledger.requests.get(namespace, {}):
                self.ledger.release(namespace, request_id)

    def request_ids(self, namespace: str) -> list[str]:
        return self.ledger.request_ids(namespace)

    def free_fraction(self, namespace: str) -> float:
        return self.ledger.free_fraction(namespace)

    def audit(self) -> AuditReport:
        return self.ledger.audit()

    def ledger_lost(self) -> bool:
        return False  # the ledger lives in this process
