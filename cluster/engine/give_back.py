"""KV given back outside a round's commit, and what it means for the requests. Each returns what the engine's
lists must become as a `GiveBack` value, which the engine applies in one place (`SpecEngine.give_back`).

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

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Parts:
    """The engine's collaborators that giving KV back calls (each changes only itself)."""

    kv: HeldCommitKV
    shared: SharedPrompts
    health: WorkerHealth
    trace: StepTrace
    inbox: RequestInbox
    namespaces: tuple[str, ...]


@dataclass(frozen=True)
class GiveBack:
    """What the engine's lists become: requests leave the batch or the queue, some join the queue's front (in this
    order); a fallback event; the chunks to emit."""

    leave: tuple[RequestState, ...] = ()
    unqueue: tuple[RequestState, ...] = ()
    requeue: tuple[RequestState, ...] = ()
    event: dict[str, Any] | None = None
    chunks: tuple[TokenChunk, ...] = ()


def check_commits(running: Iterable[RequestState], kv: HeldCommitKV, commits: Sequence[CommitItem],
                  results: Sequence[Any]) -> None:
    """Outcomes of a commit whenever it reaches the ledger (held_commit.py)."""
    for item, res in zip(commits, results, strict=True):
        if not isinstance(res, KVError):
            continue
        if item.namespace == TARGET_NAMESPACE:
            raise res
        log.warning("draft commit refused for %s (%s); the drafter re-prefills it", item.request_id, res)
        for state in running:  # the ledger and our draft_cached disagree: start the draft cache over
            if state.request_id == item.request_id and state.draft_admitted:
                kv.release(state.request_id, [DRAFT_NAMESPACE])
                state.forget_draft_kv()


def restart_draft_caches(running: Iterable[RequestState], shared: SharedPrompts) -> None:
    """The drafter's epoch changed: its grants are gone, so every request re-enters the draft namespace."""
    for state in running:
        state.forget_draft_kv()
    shared.draft_lost()


def recover_verifier(parts: Parts, running: Sequence[RequestState], flights: Sequence[InFlight],
                     reason: str) -> GiveBack:
    """The target KV is gone: groups in flight landed first (`flights`: their drafts are dropped), the verifier's
    epoch is renewed, and every running request gives back its draft cache and is requeued to re-prefill from its
    tokens (nothing emitted is lost; a waiting request holds nothing in the ledger)."""
    log.error("%s; re-prefilling %d running requests", reason, len(running))
    for flight in flights:
        failure = flight.future.exception() if flight.future is not None else None
        if failure is not None:  # the drafter failed meanwhile: its epoch expires as on any failure
            parts.health.drafter_failed(failure)
    parts.health.renew_verifier(reason)
    for state in reversed(running):
        parts.trace.rollback(state, f"verifier lost: {reason}")
        if state.draft_admitted:  # this round's draft reservation goes with it
            parts.kv.release(state.request_id, [DRAFT_NAMESPACE])
        state.forget_kv()
    return GiveBack(leave=tuple(running), requeue=tuple(running))


def preempt(parts: Parts, state: RequestState, reason: str = OUT_OF_BLOCKS) -> GiveBack:
    """Give all of a request's KV back and requeue it; it re-prefills from its tokens (nothing is lost). `reason`:
    out of blocks, or a slot yielded to another tenant (fair_share.py)."""
    log.log(logging.WARNING if reason == OUT_OF_BLOCKS else logging.INFO, "preempting %s: %s", state.request_id, reason)
    parts.trace.rollback(state, f"preempted: {reason}")
    parts.kv.release(state.request_id, parts.namespaces)
    state.forget_kv()
    return GiveBack(leave=(state,), requeue=(state,),
                    event={"at": time.time(), "request_id": state.request_id, "event": "preempted", "reason": reason})


def abort_now(parts: Parts, running: Sequence[RequestState], waiting: Iterable[RequestState],
              request_id: str) -> GiveBack:
    for state in running:
        if state.request_id == request_id:
            parts.trace.rollback(state, "aborted")
            if not (FAULTS.active and FAULTS.take("engine.skip_abort_rollback") is not None):  # chaos control
                parts.kv.release(request_id, parts.namespaces)
            parts.shared.leave(state, waiting)  # a prefiller aborted during its group's prefill
            return GiveBack(leave=(state,), chunks=(_aborted_chunk(parts, state),))
    for state in waiting:
        if state.request_id == request_id:  # a waiting request holds nothing in the ledger: nothing to release
            assert not (state.admitted or state.draft_admitted), f"waiting {request_id} holds KV"
            parts.shared.leave(state, waiting)
            return GiveBack(unqueue=(state,), chunks=(_aborted_chunk(parts, state),))
    return GiveBack()


def _aborted_chunk(parts: Parts, state: RequestState) -> TokenChunk:
    state.finish_reason = "abort"
    parts.inbox.forget(state.request_id)
    return TokenChunk(state.request_id, [], "", finish_reason="abort", stats=state.stats(), offset=state.num_output)


__all__ = ["GiveBack", "OUT_OF_BLOCKS", "Parts", "abort_now", "check_commits", "preempt", "recover_verifier",
           "restart_draft_caches"]
