"""KV given back outside a round's commit, and what it means for the requests (engine.py calls these).

    check_commits         a commit's outcomes when it reaches the ledger: a refused target commit raises; a
                          refused draft commit restarts that request's draft cache
    restart_draft_caches  the drafter's epoch changed: every request re-enters the draft namespace
    recover_verifier      the target KV is gone: every running request is requeued and re-prefills
    preempt               out of blocks, or a slot for another tenant: one request gives all its KV back and is
                          requeued
    abort_now             an abort: a running request releases its KV; a waiting one holds none

Nothing emitted is ever lost: tokens are the truth, caches are rebuilt from them. Owner: the engine thread.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from cluster.engine.config import DRAFT_NAMESPACE, TARGET_NAMESPACE
from cluster.engine.held_commit import HeldCommitKV
from cluster.engine.inbox import RequestInbox
from cluster.engine.overlap import InFlight
from cluster.engine.request_state import RequestState
from cluster.engine.shared_prompts import SharedPrompts
from cluster.engine.step_trace import StepTrace
from cluster.engine.worker_health import WorkerHealth
from kv_manager.errors import KVError
from kv_manager.schema import CommitItem
from specserve_types.api import TokenChunk
from specserve_types.faults import FAULTS

log = logging.getLogger("specserve.engine")
OUT_OF_BLOCKS = "out of KV blocks"


class ModeHooks(Protocol):
    def draft_caches_restarted(self) -> None: ...

    def drain(self) -> list[InFlight]: ...


class EngineParts(Protocol):
    """What giving KV back touches of the engine (SpecEngine has all of it)."""

    running: list[RequestState]
    waiting: collections.deque[RequestState]
    kv: HeldCommitKV
    shared: SharedPrompts
    health: WorkerHealth
    trace: StepTrace
    inbox: RequestInbox
    namespaces: list[str]
    fallback_events: list[dict[str, Any]]

    @property
    def mode(self) -> ModeHooks: ...


def check_commits(engine: EngineParts, commits: Sequence[CommitItem], results: Sequence[Any]) -> None:
    """Outcomes of a commit whenever it reaches the ledger (held_commit.py)."""
    for item, res in zip(commits, results, strict=True):
        if not isinstance(res, KVError):
            continue
        if item.namespace == TARGET_NAMESPACE:
            raise res
        log.warning("draft commit refused for %s (%s); the drafter re-prefills it", item.request_id, res)
        for state in engine.running:  # the ledger and our draft_cached disagree: start the draft cache over
            if state.request_id == item.request_id and state.draft_admitted:
                engine.kv.release(state.request_id, [DRAFT_NAMESPACE])
                state.forget_draft_kv()


def restart_draft_caches(engine: EngineParts) -> None:
    """The drafter's epoch changed: its grants are gone, so every request re-enters the draft namespace."""
    engine.mode.draft_caches_restarted()
    for state in engine.running:
        state.forget_draft_kv()
    engine.shared.draft_lost()


def recover_verifier(engine: EngineParts, reason: str) -> None:
    """The target KV is gone: groups in flight land first (their drafts are dropped), the verifier's epoch
    is renewed, and every running request gives back its draft cache and is requeued to re-prefill from
    its tokens (nothing emitted is lost; a waiting request holds nothing in the ledger)."""
    log.error("%s; re-prefilling %d running requests", reason, len(engine.running))
    for flight in engine.mode.drain():
        failure = flight.future.exception() if flight.future is not None else None
        if failure is not None:  # the drafter failed meanwhile: its epoch expires as on any failure
            engine.health.drafter_failed(failure)
    engine.health.renew_verifier(reason)
    for state in reversed(engine.running):
        engine.trace.rollback(state, f"verifier lost: {reason}")
        if state.draft_admitted:  # this round's draft reservation goes with it
            engine.kv.release(state.request_id, [DRAFT_NAMESPACE])
        state.forget_kv()
        engine.waiting.appendleft(state)
    engine.running.clear()
    engine.shared.target_lost(engine.waiting)


def preempt(engine: EngineParts, state: RequestState, reason: str = OUT_OF_BLOCKS) -> None:
    """Give all of a request's KV back and requeue it; it re-prefills from its tokens (nothing is lost). `reason`:
    out of blocks, or a slot yielded to another tenant (fair_share.py)."""
    log.log(logging.WARNING if reason == OUT_OF_BLOCKS else logging.INFO, "preempting %s: %s", state.request_id, reason)
    engine.trace.rollback(state, f"preempted: {reason}")
    engine.kv.release(state.request_id, engine.namespaces)
    engine.running.remove(state)
    state.forget_kv()
    engine.waiting.appendleft(state)
    engine.fallback_events.append({"at": time.time(), "request_id": state.request_id, "event": "preempted",
                                   "reason": reason})


def abort_now(engine: EngineParts, request_id: str) -> list[TokenChunk]:
    for state in list(engine.running):
        if state.request_id == request_id:
            engine.running.remove(state)
            engine.trace.rollback(state, "aborted")
            if not (FAULTS.active and FAULTS.take("engine.skip_abort_rollback") is not None):  # chaos control
                engine.kv.release(request_id, engine.namespaces)
            engine.shared.leave(state, engine.waiting)  # a prefiller aborted during its group's prefill
            return [_aborted_chunk(engine, state)]
    for state in list(engine.waiting):
        if state.request_id == request_id:  # a waiting request holds nothing in the ledger: nothing to release
            assert not (state.admitted or state.draft_admitted), f"waiting {request_id} holds KV"
            engine.waiting.remove(state)
            engine.shared.leave(state, engine.waiting)
            return [_aborted_chunk(engine, state)]
    return []


def _aborted_chunk(engine: EngineParts, state: RequestState) -> TokenChunk:
    state.finish_reason = "abort"
    engine.inbox.forget(state.request_id)
    return TokenChunk(state.request_id, [], "", finish_reason="abort", stats=state.stats(), offset=state.num_output)


__all__ = ["EngineParts", "abort_now", "check_commits", "preempt", "recover_verifier", "restart_draft_caches"]
