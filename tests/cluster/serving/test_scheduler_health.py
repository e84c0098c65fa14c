"""The Scheduler's health check and the KV manager actor: a ledger lost for good (its actor dead, or not rebuilt)
makes the replica unhealthy (Serve replaces it with a new engine and ledger); a refused or slow ledger call does
not, and a restarted actor is rebuilt by the check (`RemoteKV.ledger_lost`) and stays.

The check itself runs over a scripted engine (no Ray); `RemoteKV.ledger_lost`, what it asks, runs against
a real KV manager actor killed and restarted by Ray (under scripts/in-netns.sh).
"""

from __future__ import annotations

import asyncio
import time
from types import ModuleType
from typing import Any

import pytest

from cluster.serving.remote_backends import RemoteKV
from kv_manager import AdmitItem, NamespaceConfig, RetriableKVError
from kv_manager.actor import KVManagerActor
from kv_manager.schema import AuditReport
from tests.cluster.serving.test_scheduler_loop import ScriptedEngine, make_scheduler
from tests.kv_manager.kv_helpers import TARGET


class LedgerEngine(ScriptedEngine):
    """A scripted engine whose ledger can restart (every call refused from then on, as RemoteKV is) or
    refuse one call (an injected commit fault: a RetriableKVError with the ledger intact)."""

    def __init__(self) -> None:
        super().__init__()
        self.restarted = False
        self.refuse_next_call = False

    def audit(self) -> AuditReport:
        if self.restarted:
            raise RetriableKVError("kv manager restarted: its ledger is empty")
        if self.refuse_next_call:
            self.refuse_next_call = False
            raise RetriableKVError("kv.commit_fail (injected fault)")
        return AuditReport(counts={})

    def ledger_lost(self) -> bool:
        return self.restarted


def test_health_check_fails_once_the_ledger_restarted_empty() -> None:
    engine = LedgerEngine()
    scheduler = make_scheduler(engine)
    asyncio.run(scheduler.check_health())  # healthy
    engine.restarted = True
    with pytest.raises(RuntimeError, match="KV manager lost its ledger"):
        asyncio.run(scheduler.check_health())


def test_health_check_survives_a_refused_ledger_call() -> None:
    """One refused call (an injected KV fault, a call in flight while the actor died) is not a lost ledger:
    the engine fails that round's requests, and the replica stays."""
    engine = LedgerEngine()
    scheduler = make_scheduler(engine)
    engine.refuse_next_call = True
    asyncio.run(scheduler.check_health())
    assert not engine.refuse_next_call  # the gauges asked, and were refused


def test_remote_kv_rebuilds_a_restarted_actor_and_sees_it_die(ray_session: ModuleType) -> None:
    actor = KVManagerActor.options(name=None).remote([NamespaceConfig(TARGET, num_blocks=4, block_size=4)])
    try:
        kv = RemoteKV(actor)
        holder = kv.register_worker("w0")
        kv.admit([AdmitItem(TARGET, "r", [1, 2, 3, 4, 5], holder)])
        assert not kv.ledger_lost()
        first = kv.incarnation
        ray_session.kill(actor, no_restart=False)  # a crash: Ray restarts it with an empty ledger
        assert wait_for(lambda: wait_for_rebuild(kv)), "the restart was never seen"  # ledger_lost rebuilt it, between rounds
        assert kv.incarnation != first and kv.request_ids(TARGET) == ["r"]
        kv.release("r", [TARGET])
        kv.audit().assert_no_leaks()
        ray_session.kill(actor, no_restart=True)  # dead for good
        assert wait_for(kv.ledger_lost), "the death was never seen"
    finally:
        ray_session.kill(actor, no_restart=True)


def wait_for_rebuild(kv: RemoteKV) -> bool:
    return not kv.ledger_lost() and bool(kv.rebuilds)


def wait_for(predicate: Any, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
