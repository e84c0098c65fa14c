"""Traces of the engine in process: one greedy request's whole span tree, exported in memory.

client span (the caller's traceparent) -> request SERVER span -> one speculative_round per round; the
batch's phase spans under the first traced round, linked from the others; attribute values equal the
response's statistics; a batch of two links instead of parenting twice; an abort leaves a kv.rollback.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Tracer

from cluster.engine.request_span import RequestSpan
from cluster.engine.round_spans import ROUND_SPAN, RoundSpans
from specserve_types.api import GenerationRequest, SamplingParams, SpecParams
from specserve_types.tracing import inject
from tests.cluster.engine.engine_helpers import local_engine

PHASES = {"kv.reserve", "verify.forward", "accept", "kv.commit", "emit"}
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" \
         "def fibonacci(n):"


@pytest.fixture()
def traced() -> Iterator[tuple[Tracer, InMemorySpanExporter]]:
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def test_one_greedy_request_span_tree(smollm2_dir: Path, traced: tuple[Tracer, InMemorySpanExporter]) -> None:
    tracer, exporter = traced
    engine = local_engine(smollm2_dir, "ngram", observer=RoundSpans(tracer), max_batch=2, max_context=256)
    ids = tuple(engine.tokenizer(PROMPT)["input_ids"])
    sampling = SamplingParams(max_tokens=24)
    with tracer.start_as_current_span("client") as client:
        parent = inject()
    span = RequestSpan.start("text_completion", "smollm2-135m", sampling, "r1", parent=parent, tracer_=tracer)
    engine.submit(GenerationRequest("r1", ids, sampling, SpecParams(contract="greedy", k=4, draft="ngram"),
                                    trace_context=span.carrier()))
    chunks = engine.run_to_completion()["r1"]
    final = chunks[-1]
    span.finish("smollm2-135m", [final.stats], [final.finish_reason])

    spans = list(exporter.get_finished_spans())
    assert {s.context.trace_id for s in spans} == {client.get_span_context().trace_id}
    (request,) = [s for s in spans if s.kind == SpanKind.SERVER]
    assert request.name == "text_completion smollm2-135m"
    assert request.parent is not None and request.parent.span_id == client.get_span_context().span_id
    stats = final.stats
    assert request.attributes["gen_ai.usage.output_tokens"] == stats["output_tokens"] == 24
    assert request.attributes["gen_ai.usage.input_tokens"] == len(ids)
    assert request.attributes["gen_ai.latency.time_to_first_token"] == stats["ttft_seconds"]
    assert request.attributes["gen_ai.response.finish_reasons"] == ("length",)

    rounds = children(spans, request)
    assert [s.name for s in rounds] == [ROUND_SPAN] * stats["rounds"] == [ROUND_SPAN] * len(chunks)
    rounds.sort(key=lambda s: s.start_time)
    for round_span, chunk in zip(rounds, chunks, strict=True):
        attributes = round_span.attributes
        assert attributes["specserve.round.drafts_proposed"] == chunk.proposed
        assert attributes["specserve.round.drafts_accepted"] == chunk.accepted
        assert attributes["specserve.round.tokens_emitted"] == len(chunk.token_ids)
        assert attributes["specserve.verifier.batch_size"] == 1
        phases = {s.name for s in children(spans, round_span)}
        assert PHASES <= phases, phases
        for phase in children(spans, round_span):
            assert round_span.start_time <= phase.start_time <= phase.end_time <= round_span.end_time
    spec = stats["speculative_decoding"]
    assert sum(s.attributes["specserve.round.drafts_accepted"] for s in rounds) == spec["num_accepted_draft_tokens"]
    assert sum(s.attributes["specserve.round.drafts_proposed"] for s in rounds) == spec["num_draft_tokens"]
    assert request.attributes["specserve.speculative_decoding.num_accepted_draft_tokens"] == \
        spec["num_accepted_draft_tokens"]
    assert spec["num_draft_tokens"] > 0, "the n-gram drafter proposed nothing: the tree has no speculation in it"


def test_a_shared_verify_is_one_span_linked_from_each_round(smollm2_dir: Path,
                                                            traced: tuple[Tracer, InMemorySpanExporter]) -> None:
    tracer, exporter = traced
    engine = local_engine(smollm2_dir, "ngram", observer=RoundSpans(tracer), max_batch=2, max_context=256)
    ids = tuple(engine.tokenizer(PROMPT)["input_ids"])
    parents = {}
    for rid in ("a", "b"):
        with tracer.start_as_current_span(f"client-{rid}") as client:
            parents[rid] = client.get_span_context()
            engine.submit(GenerationRequest(rid, ids, SamplingParams(max_tokens=6), SpecParams("greedy", 2, "ngram"),
                                            trace_context=inject()))
    engine.step()  # both admitted and verified in one forward
    engine.abort("b")
    engine.run_to_completion()

    spans = list(exporter.get_finished_spans())
    first_step = min((s for s in spans if s.name == ROUND_SPAN), key=lambda s: s.start_time).start_time
    rounds = [s for s in spans if s.name == ROUND_SPAN and s.start_time == first_step]
    assert len(rounds) == 2 and {s.context.trace_id for s in rounds} == {p.trace_id for p in parents.values()}
    host, other = sorted(rounds, key=lambda s: len(children(spans, s)), reverse=True)
    verify = [s for s in children(spans, host) if s.name == "verify.forward"]
    assert len(verify) == 1 and verify[0].attributes["specserve.requests"] == 2
    assert not children(spans, other)
    assert verify[0].context.span_id in {link.context.span_id for link in other.links}
    (rollback,) = [s for s in spans if s.name == "kv.rollback"]
    assert rollback.attributes["specserve.kv.rollback_reason"] == "aborted"
    assert rollback.context.trace_id == parents["b"].trace_id
    engine.check_ledger()
