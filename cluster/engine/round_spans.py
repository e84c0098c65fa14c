"""Engine steps as OpenTelemetry spans (an EngineObserver; attached when tracing is on).

Per traced request verified in a step, one `speculative_round` span, child of the request's span (its W3C
carrier, `GenerationRequest.trace_context`), timed as the step, with the round's figures as attributes.
The step's phases (kv.reserve, draft.propose, verify.forward, accept, kv.commit, emit) ran once for the
whole batch: they are child spans of the first traced request's round and every other traced round links
to them (a link, not a second parent: one verify forward, several requests). KV given back outside a
commit (abort, preemption, verifier loss) is a `kv.rollback` span under the request, with its reason.
Spans are made after the step, with the recorded start and end times, so tracing adds nothing to a round's
critical path but this bookkeeping. docs/ARCHITECTURE.md §2.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, Span

from cluster.engine.step_record import Carrier, RoundRecord, StepRecord
from specserve_types.tracing import extract, inject, tracer

ROUND_SPAN = "speculative_round"


def round_attributes(record: StepRecord, round_: RoundRecord) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "specserve.request_id": round_.request_id,
        "specserve.round.k": round_.k,
        "specserve.round.drafts_proposed": round_.proposed,
        "specserve.round.drafts_accepted": round_.accepted,
        "specserve.round.tokens_emitted": round_.emitted,
        "specserve.round.contract": round_.contract,
        "specserve.round.draft": round_.draft,
        "specserve.verifier.replica": record.verifier or "",
        "specserve.verifier.batch_size": record.batch_size,
    }
    if record.drafter is not None:
        attributes["specserve.drafter.replica"] = record.drafter
    if round_.first_rejected is not None:
        attributes["specserve.round.first_rejected_position"] = round_.first_rejected
    if round_.finish_reason is not None:
        attributes["specserve.round.finish_reason"] = round_.finish_reason
    return attributes


class RoundSpans:
    def __init__(self, tracer_: trace.Tracer | None = None) -> None:
        self._tracer = tracer_ or tracer()

    def begin(self, record: StepRecord, traced: list[tuple[str, Carrier]]) -> None:
        """Begin the host round (the first traced request's) before the worker calls, so the drafter and the
        verifier continue its trace: its carrier travels in ProposeBatch / VerifyBatch."""
        for request_id, carrier in traced:
            span = self._tracer.start_span(ROUND_SPAN, context=extract(carrier), start_time=record.start_ns)
            if span.is_recording():
                record.host, record.host_request = span, request_id
                record.carrier = inject(trace.set_span_in_context(span))
                return

    def step(self, record: StepRecord) -> None:
        host: Span | None = record.host
        if host is None:  # no host begun (no worker call carried a trace): the first sampled traced round hosts
            for round_ in record.rounds:
                if not round_.trace_context:
                    continue
                span = self._tracer.start_span(ROUND_SPAN, context=extract(round_.trace_context),
                                               start_time=record.start_ns)
                if span.is_recording():
                    host, record.host_request = span, round_.request_id
                    break
        links: list[Link] = []
        if host is not None:  # the batch's phases hang under the host round; the other rounds link to them
            hosted = next((r for r in record.rounds if r.request_id == record.host_request), None)
            host.set_attributes(round_attributes(record, hosted) if hosted is not None else
                                {"specserve.request_id": record.host_request or "", "specserve.round.skipped": True})
            links = self._phases(record, host)
        for round_ in record.rounds:
            if not round_.trace_context or round_.request_id == record.host_request:
                continue
            span = self._tracer.start_span(ROUND_SPAN, context=extract(round_.trace_context),
                                           start_time=record.start_ns, links=links,
                                           attributes=round_attributes(record, round_))
            span.end(end_time=record.end_ns)
        if host is not None:
            host.end(end_time=record.end_ns)
        for rollback in record.rollbacks:
            if rollback.trace_context:
                span = self._tracer.start_span("kv.rollback", context=extract(rollback.trace_context),
                                               start_time=rollback.at_ns,
                                               attributes={"specserve.request_id": rollback.request_id,
                                                           "specserve.kv.rollback_reason": rollback.reason})
                span.end(end_time=rollback.at_ns)

    def _phases(self, record: StepRecord, parent: Span) -> list[Link]:
        context = trace.set_span_in_context(parent)
        links = []
        for phase in record.phases:
            attributes = {f"specserve.{key}": value for key, value in phase.attributes.items()}
            attributes["specserve.batch.requests"] = record.batch_size
            span = self._tracer.start_span(phase.name, context=context, start_time=phase.start_ns,
                                           attributes=attributes)
            span.end(end_time=phase.end_ns)
            links.append(Link(span.get_span_context(), {"specserve.phase": phase.name}))
        return links
