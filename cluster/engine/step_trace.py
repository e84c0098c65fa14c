"""What the engine's observer (traces, metrics) sees of a step: its `StepRecord` (step_record.py), and the W3C
trace context the step's worker and ledger calls continue.

    start        a fresh record per step, while an observer is attached (and not muted: warm-up)
    begin(plans) once a traced request is among the step's plans: the observer begins the host round span and
                 the record's `trace_context` is what the worker calls send (CURRENT_CARRIER: the ledger calls)
    phase        timed phases of the round; rollbacks, rounds, fallback events
    finish       the record goes to the observer (an observer's failure never fails a round)

Owner: the engine thread. The engine writes nothing of a record itself: it calls these.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from cluster.engine.step_record import EngineObserver, Rollback, RoundRecord, StepRecord, new_step_record
from specserve_types.tracing import CURRENT_CARRIER

if TYPE_CHECKING:
    from cluster.engine.accept import RoundOutcome
    from cluster.engine.request_state import RequestState
    from cluster.engine.round_plan import RoundPlan

log = logging.getLogger("specserve.engine")

Carrier = tuple[tuple[str, str], ...]


class StepTrace:
    def __init__(self, observer: EngineObserver | None) -> None:
        self._observer = observer
        self._muted = False
        self._record: StepRecord | None = None  # this step's, while an observer is attached
        self._events_seen = 0  # fallback events already handed to the observer

    @property
    def observer(self) -> EngineObserver | None:
        return self._observer

    @contextmanager
    def muted(self) -> Iterator[None]:
        """Steps inside are not handed to the observer (warm-up: its rounds are not the users')."""
        self._muted, before = True, self._muted
        try:
            yield
        finally:
            self._muted = before

    def start(self) -> None:
        self._record = new_step_record() if self._observer is not None and not self._muted else None

    # ------------------------------------------------------------------ during the step
    def begin(self, plans: Sequence[RoundPlan]) -> None:
        """The step's host span, once a traced request is among `plans` (at most once a step)."""
        record = self._record
        if record is None or record.host_request is not None or record.carrier:
            return
        traced = [(p.state.request_id, p.state.request.trace_context) for p in plans if p.state.request.trace_context]
        if traced:
            self._observer.begin(record, traced)  # type: ignore[union-attr]
            CURRENT_CARRIER.set(record.carrier)  # the KV client sends it with this step's ledger calls

    @property
    def trace_context(self) -> Carrier:
        """The W3C context the worker calls of this step continue (empty unless a traced request began it)."""
        return self._record.carrier if self._record is not None else ()

    def phase(self, name: str, **attributes: Any) -> AbstractContextManager[dict[str, Any]]:
        return self._record.phase(name, **attributes) if self._record is not None else nullcontext(attributes)

    def add_phase(self, name: str, seconds: float, **attributes: Any) -> None:
        if self._record is not None:
            self._record.add_phase(name, seconds, **attributes)

    def rollback(self, state: RequestState, reason: str) -> None:
        if self._record is not None:
            self._record.rollbacks.append(Rollback(state.request_id, state.request.trace_context, reason,
                                                   time.time_ns()))

    def rounds(self, plans: Sequence[RoundPlan], outcome: RoundOutcome) -> None:
        record = self._record
        if record is None:
            return
        chunks = {chunk.request_id: chunk for chunk in outcome.chunks}
        trees = {a.request_id: a for a in outcome.acceptance if a.tree_nodes}
        record.batch_size = len(plans)
        for plan in plans:
            if plan.prefill_to is not None:  # a prompt group's prefill: no round of the request's own
                continue
            spec, chunk = plan.state.request.spec, chunks[plan.state.request_id]
            tree = trees.get(plan.request_id)
            record.rounds.append(RoundRecord(
                plan.state.request_id, plan.state.request.trace_context, plan.k, len(plan.drafts), chunk.proposed,
                chunk.accepted, len(chunk.token_ids), spec.contract,
                "none" if plan.k == 0 else "model" if plan.uses_model_drafter else spec.draft, chunk.finish_reason,
                tree_nodes=tree.tree_nodes if tree else 0, accepted_ranks=tree.ranks if tree else ()))

    # ------------------------------------------------------------------ the step's end
    def events_reset(self) -> None:
        self._events_seen = 0

    def finish(self, events: Sequence[dict[str, Any]], drafter: object | None, verifier: object) -> None:
        """Hand the step's record to the observer (if anything happened in it)."""
        record, self._record = self._record, None
        if record is None:
            return
        CURRENT_CARRIER.set(())
        record.fallbacks = [str(e.get("event", "unknown")) for e in events[self._events_seen:]]
        self._events_seen = len(events)
        if not (record.rounds or record.rollbacks or record.fallbacks or record.host is not None):
            return
        record.end_ns = time.time_ns()
        record.drafter = None if drafter is None else str(drafter)
        record.verifier = str(verifier)
        try:
            self._observer.step(record)  # type: ignore[union-attr]
        except Exception:  # an observer's failure must not fail a round
            log.exception("engine observer failed; its step record is dropped")


__all__ = ["StepTrace"]
