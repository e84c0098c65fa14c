"""The KV manager as a Ray actor.

    engine -> RemoteKV (cluster/serving/remote_backends.py, synchronous) -> KVManagerActor (Ray actor)
           -> BlockLedger

In the cluster, `build_cluster_engine` creates one actor per Scheduler replica
(`KVManagerActor.options(name=None).remote(namespaces)`) and its engine is the only client.
One batch call per step of a round: `reserve` for the whole batch before the forward, `commit`
after it (`CommitItem.finished` releases finished requests in the same call): at most two RPCs per
round. The `*_with_free` forms also return the pools' free fractions, which the scheduler's policy
reads every round, so that reading costs no third call; `commit_then_reserve_with_free` carries a
round's commit together with the next round's reserve when the scheduler defers the commit (then a
round costs one call). Every ledger call holds the manager's lock, so concurrent callers (Ray calls on the
actor's event loop, round-channel calls on the channel's thread: `channel()`, specserve_types/round_channel.py)
never interleave inside a ledger call.

Restart policy (KVManagerActor's options): Ray restarts the actor forever (max_restarts=-1) and never
re-runs a call on the new instance (max_task_retries=0). What a restart means:
  - the new instance's ledger starts EMPTY under a new incarnation id; every call carries the id its client
    knows, and a call under another id is refused with LedgerRestarted (a RetriableKVError);
  - a call in flight when the actor died fails (the connection breaks, or Ray's call raises);
  - recovery, by the client (RemoteKV, cluster/serving/remote_backends.py): it waits for the new instance and
    sends `rebuild(live_state)`, the ledger as its answers left it (kv_manager/live_state.py); the new instance
    builds its ledger from it (kv_manager/rebuild.py: the same block ids, holders and epochs, so the workers' KV
    stays right) under a fresh incarnation, and the client sends the failed call again. Requests in flight go on,
    exact, after a pause (docs/ARCHITECTURE.md §6); no request re-prefills.
`rebuild` replaces whatever ledger the instance holds, so it is for the one client only (each scheduler replica's
engine owns its actor); the fresh incarnation refuses any call still on its way under the one before.
A caller that gives up on a call (a timeout) may leave it running on the actor: it must `release` afterwards.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import ray

from kv_manager.errors import KVError, LedgerRestarted, RetriableKVError
from kv_manager.ledger import BlockLedger
from kv_manager.live_state import LiveState
from kv_manager.rebuild import rebuild_ledger
from kv_manager.schema import (
    Admission,
    AdmitItem,
    AuditReport,
    CommitItem,
    CommitResult,
    Holder,
    NamespaceConfig,
    RequestKey,
    Reservation,
    ReserveItem,
)
from specserve_types.faults import FAULTS, FaultHooks
from specserve_types.ray_channel import ChannelHost
from specserve_types.round_channel import Handler
from specserve_types.tracing import Carrier, TracingSettings, configure_tracing, tracing_enabled, worker_span

T = TypeVar("T")


def traced(name: str, carrier: Carrier, items: int) -> AbstractContextManager[Any]:
    """The caller's traced step continues here (a SERVER span per ledger call); nothing when untraced."""
    return worker_span(name, carrier, items) if carrier and tracing_enabled() else nullcontext()


def _each(call: Any, items: Iterable[Any]) -> list[Any]:
    outcomes = []
    for item in items:
        try:
            outcomes.append(call(item))
        except KVError as refusal:
            outcomes.append(refusal)
    return outcomes


CHANNEL_METHODS = ("incarnation", "register_worker", "expire_worker", "add_requests", "fork", "forks", "request_ids",
                   "reserve", "commit", "reserve_with_free", "commit_with_free", "commit_then_reserve_with_free",
                   "rollback", "release", "can_admit", "free_fractions", "audit")


def _serial(method: Callable[..., T]) -> Callable[..., T]:
    """A ledger call under the manager's lock: a Ray call (on the actor's event loop) and a round-channel call
    (on its connection thread) never interleave inside the ledger."""

    @functools.wraps(method)
    def call(self: KVManager, *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return method(self, *args, **kwargs)

    return call


class KVManager(FaultHooks, ChannelHost):
    """The actor's body (also usable in-process). Each method takes the caller's incarnation first.
    Owner of the ledger; every ledger call holds `_lock` (`_serial`)."""

    def __init__(self, namespaces: Sequence[NamespaceConfig]) -> None:
        self._lock = threading.Lock()
        self._namespaces = list(namespaces)
        # epochs of this instance start at its start time: no epoch of an earlier instance comes back
        self._ledger = BlockLedger(self._namespaces, first_epoch=time.time_ns())
        self._incarnation = uuid.uuid4().hex
        configure_tracing(TracingSettings.from_env(), "specserve-kv-manager")  # env from the scheduler's options

    def _check(self, incarnation: str) -> BlockLedger:
        if incarnation != self._incarnation:
            raise LedgerRestarted(
                f"kv manager restarted or rebuilt (incarnation {incarnation} -> {self._incarnation}): "
                "rebuild its ledger from the live state, then call again"
            )
        return self._ledger

    def incarnation(self) -> str:
        return self._incarnation

    @_serial
    def rebuild(self, live: LiveState) -> str:
        """Replace the ledger with one rebuilt from its client's live state (kv_manager/rebuild.py); returns the new
        incarnation. An inconsistent state raises InconsistentLiveState and leaves the ledger as it was."""
        self._ledger = rebuild_ledger(self._namespaces, live, first_epoch=time.time_ns())
        self._incarnation = uuid.uuid4().hex
        return self._incarnation

    @staticmethod
    def _injected(name: str) -> None:
        if FAULTS.active and FAULTS.take(name) is not None:
            raise RetriableKVError(f"{name} (injected fault)")

    @_serial
    def register_worker(self, incarnation: str, worker_id: str) -> Holder:
        return self._check(incarnation).register_worker(worker_id)

    @_serial
    def expire_worker(self, incarnation: str, worker_id: str) -> int:
        return self._check(incarnation).expire_worker(worker_id)

    @_serial
    def add_requests(self, incarnation: str, items: Sequence[AdmitItem]) -> list[Admission | KVError]:
        ledger = self._check(incarnation)
        return _each(lambda i: ledger.add_request(i.namespace, i.request_id, i.prompt_token_ids, i.holder), items)

    @_serial
    def fork(self, incarnation: str, namespace: str, parent_id: str, child_id: str) -> Admission:
        return self._check(incarnation).fork(namespace, parent_id, child_id)

    @_serial
    def forks(self, incarnation: str, items: Sequence[tuple[str, str, str]]) -> list[Admission | KVError]:
        """(namespace, parent_id, child_id) each, answered per item."""
        ledger = self._check(incarnation)
        return _each(lambda item: ledger.fork(*item), items)

    @_serial
    def request_ids(self, incarnation: str, namespace: str) -> list[str]:
        return self._check(incarnation).request_ids(namespace)

    @_serial
    def reserve(
        self, incarnation: str, items: Sequence[ReserveItem], atomic: bool = False
    ) -> list[Reservation | KVError]:
        return self._check(incarnation).reserve(items, atomic=atomic)

    @_serial
    def commit(self, incarnation: str, items: Sequence[CommitItem]) -> list[CommitResult | KVError]:
        return self._check(incarnation).commit(items)

    @_serial
    def reserve_with_free(
        self, incarnation: str, items: Sequence[ReserveItem], atomic: bool = False, trace_context: Carrier = ()
    ) -> tuple[list[Reservation | KVError], dict[str, float]]:
        """`reserve`, plus every namespace's free fraction after it (spares a `free_fractions` call)."""
        with traced("kv.reserve", trace_context, len(items)):
            self._injected("kv.reserve_fail")
            outcomes = self._check(incarnation).reserve(items, atomic=atomic)
            return outcomes, self._fractions()

    @_serial
    def commit_with_free(
        self, incarnation: str, items: Sequence[CommitItem], trace_context: Carrier = ()
    ) -> tuple[list[CommitResult | KVError], dict[str, float]]:
        """`commit`, plus every namespace's free fraction after it."""
        with traced("kv.commit", trace_context, len(items)):
            self._injected("kv.commit_fail")
            outcomes = self._check(incarnation).commit(items)
            return outcomes, self._fractions()

    @_serial
    def commit_then_reserve_with_free(
        self, incarnation: str, commits: Sequence[CommitItem], reserves: Sequence[ReserveItem],
        trace_context: Carrier = (),
    ) -> tuple[list[CommitResult | KVError], list[Reservation | KVError], dict[str, float]]:
        """The previous round's `commit`, then this round's `reserve`, in one call (one round trip)."""
        with traced("kv.commit_then_reserve", trace_context, len(commits) + len(reserves)):
            self._injected("kv.commit_fail")
            self._injected("kv.reserve_fail")
            ledger = self._check(incarnation)
            committed = ledger.commit(commits)
            return committed, ledger.reserve(reserves), self._fractions()

    @_serial
    def rollback(self, incarnation: str, keys: Sequence[RequestKey]) -> list[int | KVError]:
        ledger = self._check(incarnation)
        return _each(lambda key: ledger.rollback(*key), keys)

    @_serial
    def release(self, incarnation: str, keys: Sequence[RequestKey]) -> list[int | KVError]:
        ledger = self._check(incarnation)
        return _each(lambda key: ledger.release(*key), keys)

    @_serial
    def can_admit(self, incarnation: str, plan: Mapping[str, int]) -> bool:
        return self._check(incarnation).can_admit(plan)

    @_serial
    def free_fractions(self, incarnation: str) -> dict[str, float]:
        self._check(incarnation)
        return self._fractions()

    def channel_handlers(self) -> dict[str, Handler]:
        """Every ledger call, also over the round channel (specserve_types/round_channel.py), under the same lock."""
        return {name: getattr(self, name) for name in CHANNEL_METHODS}

    def _fractions(self) -> dict[str, float]:
        return {namespace: self._ledger.free_fraction(namespace) for namespace in self._ledger.pools}

    @_serial
    def audit(self, incarnation: str) -> AuditReport:
        return self._check(incarnation).audit()


KVManagerActor = ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0, max_concurrency=1000)(KVManager)
