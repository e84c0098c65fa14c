"""The engine's KV client: one commit that may wait for the next ledger call, and reservation windows.

Held commits. A steady round's commit need not reach the ledger before the next round's reserve: `commit(items,
hold=True)` keeps it and the next ledger call carries it (`commit_then_reserve`, one round trip). Every other
ledger call sends a held commit first, so nothing ever sees the ledger behind the engine; the engine holds nothing
with two-group overlap or when a request finished in the round (a client that sees its last token sees its blocks
released).

Reservation windows (serial steps, docs/ARCHITECTURE.md §4). While round r verifies, `ahead(...).send()` sends the held
commit of round r - 1 and grows each request's reservation to cover round r + 1 as well (`ReserveItem.extend`,
sized by the plan's maximum), on a call that overlaps the verify (`land_ahead` takes its answer after it). The
ledger keeps a window's rest across commits (`CommitItem.keep_reserved`), so round r + 1's `reserve` finds its
slots granted already and makes no call: the ledger still grants every slot before the round that writes it, and
commits every accepted prefix, one round later. A plan that outgrows its window (a longer catch-up, a larger
tree) extends it in the round's own call, as without windows; an extend the ledger refuses leaves the window as
it was. A rollback, a release, an expired or re-registered worker, a new admission end the key's window.

A commit's outcomes go to `check(items, outcomes)` whenever it is sent (the engine raises on a refused target
commit and restarts a refused draft cache). Owner of `held` and `windows`: the engine thread (the ahead call's
thread only carries a call made from it; with two-group overlap nothing is held; the draft thread never makes a
ledger call).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cluster.engine.kv_client import ForkItem, KVClient, PendingRound
from kv_manager.errors import KVError
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

CommitCheck = Callable[[Sequence[CommitItem], Sequence[Any]], None]
Key = tuple[str, str]  # (namespace, request_id)


@dataclass(frozen=True)
class Window:
    """A request's reservation in the ledger past its committed positions, as the engine knows it: `grant` starts
    at the request's first uncommitted position (held commits counted)."""

    holder: Holder
    grant: Reservation

    def fits(self, item: ReserveItem) -> bool:
        return item.holder == self.holder and item.num_new_slots <= len(self.grant.slot_mapping)

    @staticmethod
    def of(holder: Holder, grant: Reservation) -> Window:
        return Window(holder, replace(grant, copy_on_write=()))  # copies run once, with the grant that asked

    def first(self, num_slots: int) -> Reservation:
        """The round's grant: the window's first `num_slots` slots."""
        return replace(self.grant, slot_mapping=self.grant.slot_mapping[:num_slots])

    def committed(self, block_table: tuple[int, ...]) -> Window:
        """After a commit of earlier positions: its table (an identical full block may have replaced one, and the
        replaced one is free for anyone), the window's own slots unchanged."""
        return Window(self.holder, replace(self.grant, block_table=block_table))

    def after(self, accepted_len: int) -> Window:
        g = self.grant
        return Window(self.holder, replace(g, start_pos=g.start_pos + accepted_len,
                                           slot_mapping=g.slot_mapping[accepted_len:], copy_on_write=()))


@dataclass
class Ahead:
    """An ahead call: the held commits it carries, the extends it asks for; `send()` starts it (once the verify is
    on its way), `future` is its answer to come. Owner: the engine thread."""

    commits: list[CommitItem]
    extends: list[ReserveItem]
    call: Callable[[list[CommitItem], list[ReserveItem]], PendingRound]
    future: PendingRound | None = None
    failure: Exception | None = None  # the call could not be sent: raised by `land_ahead`, not by the verify's hook
    send_seconds: float = 0.0  # the engine thread's own time in `send` (all of the call where it is in process)
    wait_seconds: float = 0.0  # the time `land_ahead` waited for its answer after the verify (the ledger's share)

    def send(self) -> None:
        if self.future is None and self.failure is None:
            start = time.perf_counter()
            try:
                self.future = self.call(self.commits, self.extends)
            except Exception as exc:  # a lost ledger: the verify goes on, the round fails when it lands
                self.failure = exc
            self.send_seconds = time.perf_counter() - start


def _key(item: Any) -> Key:
    return item.namespace, item.request_id


class HeldCommitKV:
    def __init__(self, inner: KVClient, check: CommitCheck) -> None:
        self.inner = inner  # LocalKV or RemoteKV
        self.check = check
        self.held: list[CommitItem] = []
        self.windows: dict[Key, Window] = {}

    # -- held commits -------------------------------------------------------------------------------
    def _take_held(self) -> list[CommitItem]:
        """The held commits, each keeping its window's rest if the key has one."""
        held, self.held = self.held, []
        if not self.windows:
            return held
        return [replace(item, keep_reserved=True) if _key(item) in self.windows and not item.finished else item
                for item in held]

    def send_held(self) -> None:
        held = self._take_held()
        if held:
            self._checked(held, self.inner.commit(held))

    def _checked(self, items: Sequence[CommitItem], outcomes: Sequence[Any]) -> None:
        """Commits that reached the ledger: windows take the tables after them, then the engine's check."""
        for item, outcome in zip(items, outcomes, strict=True) if self.windows else ():
            window = self.windows.get(_key(item))
            if window is not None and isinstance(outcome, CommitResult):
                self.windows[_key(item)] = window.committed(outcome.block_table)
        self.check(items, outcomes)

    # -- the round's calls --------------------------------------------------------------------------
    def reserve(self, items: Sequence[ReserveItem]) -> list[Reservation | KVError]:
        """The round's grants: from the windows where they fit (no call), the rest in one call that carries the
        held commit (a key with a window extends it)."""
        if not self.windows:
            return self._call(list(items))
        fits = [(w := self.windows.get(_key(item))) is not None and w.fits(item) for item in items]
        asked = [(index, replace(item, extend=True) if _key(item) in self.windows else item)
                 for index, item in enumerate(items) if not fits[index]]
        answers = dict(zip((index for index, _ in asked), self._call([item for _, item in asked]), strict=True)) \
            if asked else {}
        out: list[Reservation | KVError] = []
        for index, item in enumerate(items):  # after the call: its held commits may have changed a table
            outcome = self.windows[_key(item)].first(item.num_new_slots) if fits[index] else answers[index]
            if isinstance(outcome, Reservation) and not fits[index] and _key(item) in self.windows:
                self.windows[_key(item)] = Window.of(item.holder, outcome)  # an extend: the grown window
                outcome = replace(outcome, slot_mapping=outcome.slot_mapping[:item.num_new_slots])
            out.append(outcome)
        return out

    def _call(self, items: list[ReserveItem]) -> list[Reservation | KVError]:
        held = self._take_held()
        if not held:
            return self.inner.reserve(items)
        committed, reserved = self.inner.commit_then_reserve(held, items)
        self._checked(held, committed)
        return reserved

    def commit(self, items: Sequence[CommitItem], hold: bool = False) -> None:
        """The round's commits: sent now, or held for the next ledger call. A window moves past the accepted
        positions (a finished request's ends)."""
        self.send_held()
        for item in items if self.windows else ():
            window = self.windows.get(_key(item))
            if window is not None:
                if item.finished:
                    del self.windows[_key(item)]
                else:
                    self.windows[_key(item)] = window.after(item.accepted_len)
        self.held = list(items)
        if not hold:
            self.send_held()

    def ahead(self, extends: Sequence[ReserveItem]) -> Ahead | None:
        """The held commit and the windows' extends (`ReserveItem.extend`) as a call to run beside the verify
        (`Ahead.send`); None where there is nothing to send."""
        commits = self._take_held()
        extends = [replace(item, extend=True) for item in extends]
        if not commits and not extends:
            return None
        return Ahead(commits, extends, self.inner.commit_then_reserve_ahead)

    def land_ahead(self, ahead: Ahead) -> None:
        """The ahead call's answer: commits checked, grown windows recorded (a refused extend leaves its window
        as it was: the next round extends it in its own call). Raises what the call raised."""
        wait_start = time.perf_counter()
        try:
            ahead.send()  # a verify that failed before its request left: the call still carries the held commit
            if ahead.failure is not None:
                raise ahead.failure
            assert ahead.future is not None
            committed, reserved = ahead.future.result()
        finally:
            ahead.wait_seconds = time.perf_counter() - wait_start
        self._checked(ahead.commits, committed)
        for item, outcome in zip(ahead.extends, reserved, strict=True):
            if isinstance(outcome, Reservation):
                self.windows[_key(item)] = Window.of(item.holder, outcome)

    def _forget(self, keys: Sequence[Key]) -> None:
        for key in keys:
            self.windows.pop(key, None)

    def _forget_worker(self, worker_id: str) -> None:
        self._forget([key for key, window in self.windows.items() if window.holder.worker_id == worker_id])

    # -- everything else sends a held commit first ---------------------------------------------------
    def register_worker(self, worker_id: str) -> Holder:
        self.send_held()
        self._forget_worker(worker_id)  # a re-registration expires the old epoch: its entries are gone
        return self.inner.register_worker(worker_id)

    def expire_worker(self, worker_id: str) -> int:
        self.send_held()
        self._forget_worker(worker_id)
        return self.inner.expire_worker(worker_id)

    def can_admit(self, items: Sequence[AdmitItem], lookahead: int) -> bool:
        self.send_held()
        return self.inner.can_admit(items, lookahead)

    def admit(self, items: Sequence[AdmitItem]) -> list[Admission]:
        self.send_held()
        self._forget([(i.namespace, i.request_id) for i in items] if self.windows else [])
        return self.inner.admit(items)

    def fork(self, items: Sequence[ForkItem]) -> list[Admission]:
        self.send_held()
        self._forget([(namespace, child) for namespace, _, child in items] if self.windows else [])
        return self.inner.fork(items)

    def rollback(self, keys: Sequence[tuple[str, str]]) -> None:
        self.send_held()
        self._forget(keys)
        self.inner.rollback(keys)

    def release(self, request_id: str, namespaces: Sequence[str]) -> None:
        self.send_held()
        self._forget([(namespace, request_id) for namespace in namespaces])
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
