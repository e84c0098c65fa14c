"""One request's SERVER span at the front door (gRPC, HTTP, `specserve generate`), in the GenAI semantic
conventions plus the latency attributes vLLM sets and the request's speculation summary.

    span = RequestSpan.start("text_completion", model, sampling, request_id, parent=carrier_from_client)
    args = replace(args, trace_context=span.carrier())     # the engine's round spans become its children
    ...
    span.finish(final_stats_of_each_completion)  |  span.fail("invalid_request", message)

A no-op when this process has no tracer provider (tracing off costs one check).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from specserve_types.api import SamplingParams
from specserve_types.protocol import IndexedChunk
from specserve_types.tracing import Carrier, extract, inject, tracer, tracing_enabled

SPEC_KEYS = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "draft_acceptance_rate",
             "mean_acceptance_length")


class RequestSpan:
    def __init__(self, span: trace.Span | None) -> None:
        self._span = span

    @classmethod
    def start(cls, operation: str, model: str, sampling: SamplingParams, request_id: str,
              parent: Iterable[tuple[str, str]] | None = None, n: int = 1,
              tracer_: trace.Tracer | None = None) -> RequestSpan:
        if tracer_ is None and not tracing_enabled():
            return cls(None)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation, "gen_ai.request.model": model, "gen_ai.response.id": request_id,
            "gen_ai.request.temperature": sampling.temperature, "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.choice.count": n,
        }
        if sampling.max_tokens is not None:  # unset: until the model ends the answer
            attributes["gen_ai.request.max_tokens"] = sampling.max_tokens
        if sampling.seed is not None:
            attributes["gen_ai.request.seed"] = sampling.seed
        span = (tracer_ or tracer()).start_span(f"{operation} {model}", context=extract(parent), kind=SpanKind.SERVER,
                                   attributes=attributes)
        return cls(span)

    def carrier(self) -> Carrier:
        """The W3C carrier that makes downstream spans (the engine's rounds) children of this one."""
        if self._span is None:
            return ()
        return inject(trace.set_span_in_context(self._span))

    def finish(self, model: str, stats: Sequence[dict[str, Any] | None], finish_reasons: Sequence[str | None]) -> None:
        """End the span with the figures of the request's completions (their final chunks' stats)."""
        if self._span is None:
            return
        done = [s for s in stats if s]
        attributes: dict[str, Any] = {"gen_ai.response.model": model,
                                      "gen_ai.response.finish_reasons": [r or "" for r in finish_reasons]}
        if done:
            attributes["gen_ai.usage.input_tokens"] = int(done[0].get("prompt_tokens", 0))
            attributes["gen_ai.usage.output_tokens"] = sum(int(s.get("output_tokens", 0)) for s in done)
            for name, key in (("gen_ai.latency.time_in_queue", "queued_seconds"),
                              ("gen_ai.latency.time_to_first_token", "ttft_seconds"),
                              ("gen_ai.latency.e2e", "e2e_seconds")):
                values = [s[key] for s in done if s.get(key) is not None]
                if values:
                    attributes[name] = min(values) if key != "e2e_seconds" else max(values)
            spec = summed_speculation(done)
            attributes |= {f"specserve.speculative_decoding.{key}": spec[key] for key in SPEC_KEYS}
            attributes["specserve.rounds"] = sum(int(s.get("rounds", 0)) for s in done)
            attributes["specserve.contract"] = str(done[0].get("contract", ""))
        self._span.set_attributes(attributes)
        if any(reason == "error" for reason in finish_reasons):
            self._span.set_attribute("error.type", "engine_error")
            self._span.set_status(Status(StatusCode.ERROR, "a completion ended in error"))
        self._span.end()

    def fail(self, error_type: str, message: str) -> None:
        if self._span is None:
            return
        self._span.set_attribute("error.type", error_type)
        self._span.set_status(Status(StatusCode.ERROR, message[:200]))
        self._span.end()


def summed_speculation(stats: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """The `speculative_decoding` figures (vLLM's shape) of several completions as one request's."""
    parts = [s.get("speculative_decoding") or {} for s in stats if s]
    steps = sum(int(p.get("num_spec_steps", 0)) for p in parts)
    drafts = sum(int(p.get("num_draft_tokens", 0)) for p in parts)
    accepted = sum(int(p.get("num_accepted_draft_tokens", 0)) for p in parts)
    histogram: list[int] = []
    for part in parts:
        for index, count in enumerate(part.get("acceptance_histogram", [])):
            histogram.extend([0] * (index + 1 - len(histogram)))
            histogram[index] += int(count)
    return {"num_spec_steps": steps, "num_draft_tokens": drafts, "num_accepted_draft_tokens": accepted,
            "draft_acceptance_rate": accepted / drafts if drafts else 0.0,
            "mean_acceptance_length": 1.0 + accepted / steps if steps else 0.0, "acceptance_histogram": histogram}


class FinalChunks:
    """The final chunk's stats and finish reason of each completion of a request, as its chunks stream by."""

    def __init__(self) -> None:
        self._final: dict[int, tuple[dict[str, Any] | None, str | None]] = {}

    def add(self, item: IndexedChunk) -> None:
        if item.chunk.finished:
            self._final[item.index] = (item.chunk.stats, item.chunk.finish_reason)

    def stats(self) -> list[dict[str, Any] | None]:
        return [self._final[index][0] for index in sorted(self._final)]

    def reasons(self) -> list[str | None]:
        return [self._final[index][1] for index in sorted(self._final)]
