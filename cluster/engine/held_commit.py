"""The engine's KV client with one commit that may wait for the next reserve.

A steady round's commit need not reach the ledger before the next round's reserve: `commit(items,
hold=True)` keeps it and the next `reserve` carries it (`commit_then_reserve`, one round trip to the
ledger per round). Every other ledger call sends a held commit first, so nothing ever sees the ledger
behind the engine; the engine holds nothing with two-group overlap or when a request finished in the round (a
client that sees its last token sees its blocks released).

A commit's outcomes go to `check(items, outcomes)` whenever it is sent (the engine raises on a refused
target commit and restarts a refused draft cache). Owner of `held`: the engine thread (with two-group
overlap nothing is held; the draft thread never makes a ledger call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cluster.engine.kv_client import ForkItem, KVClient
from kv_manager.errors import KVError
from kv_manager.schema import Admission, AdmitItem, AuditReport, CommitItem, Holder, Reservation, ReserveItem

CommitCheck = Callable[[Sequence[CommitItem], Sequence[Any]], None]


class HeldCommitKV:
    def __init__(self, inner: KVClient, check: CommitCheck) -> None:
        self.inner = inner  # LocalKV or RemoteKV
        self.check = check
        self.held: list[CommitItem] = []

    def send_held(self) -> None:
        held, self.held = self.held, []
        if held:
            self.check(held, self.inner.commit(held))

    # -- the round's two calls --------------------------------------------------------------------
    def reserve(self, items: Sequence[ReserveItem]) -> list[Reservation | KVError]:
        held, self.held = self.held, []
        if not held:
            return self.inner.reserve(items)
        committed, reserved = self.inner.commit_then_reserve(held, items)
        self.check(held, committed)
        return reserved

    def commit(self, items: Sequence[CommitItem], hold: bool = False) -> None:
        self.send_held()
        if hold:
            self.held = list(items)
        else:
            self.check(items, self.inner.commit(items))

    # -- everything else sends a held commit first ---------------------------------------------------
    def register_worker(self, worker_id: str) -> Holder:
        self.send_held()
        return self.inner.register_worker(worker_id)

    def expire_worker(self, worker_id: str) -> int:
        self.send_held()
        return self.inner.expire_worker(worker_id)

    def can_admit(self, items: Sequence[AdmitItem], lookahead: int) -> bool:
        self.send_held()
        return self.inner.can_admit(items, lookahead)

    def admit(self, items: Sequence[AdmitItem]) -> list[Admission]:
        self.send_held()
        return self.inner.admit(items)

    def fork(self, items: Sequence[ForkItem]) -> list[Admission]:
        self.send_held()
        return self.inner.fork(items)

    def rollback(self, keys: Sequence[tuple[str, str]]) -> None:
        self.send_held()
        self.inner.rollback(keys)

    def release(self, request_id: str, namespaces: Sequence[str]) -> None:
        self.send_held()
        self.inner.release(request_id, namespaces)

    def audit(self) -> AuditReport:
        self.send_held()
        return self.inner.audit()

    def request_ids(self, namespace: str) -> list[str]:
        self.send_held()
        return self.inner.request_ids(namespace)

    def ledger_lost(self) -> bool:
        return self.inner.ledger_lost()  # nothing to send first: a lost ledger refuses it anyway

    def free_fraction(self, namespace: str) -> float:
        return self.inner.free_fraction(namespace)  # read every round by the policy: a held commit may wait
