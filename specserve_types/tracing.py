"""OpenTelemetry tracing for every specserve process: settings, exporters, and W3C context carriers.

Off by default. `TracingSettings` says where spans go (an OTLP endpoint and/or a JSON-lines file) and the
parent-based sampling ratio; `configure_tracing(settings, service)` installs the process's tracer provider
once. The Serve replicas and the KV actor are other processes: they receive the settings as environment
variables (`TracingSettings.env()`, put in each deployment's runtime_env) and call
`configure_tracing(TracingSettings.from_env(), ...)` at start-up. The standard `OTEL_EXPORTER_OTLP_*`
variables are honoured by the OTLP exporter itself.

Context crosses process boundaries as a W3C `traceparent`/`tracestate` carrier, a tuple of (key, value)
pairs that pickles and fits in gRPC metadata: `inject()` and `extract(carrier)`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACER_NAME = "specserve"
ENV_TRACE_FILE = "SPECSERVE_TRACE_FILE"
ENV_OTLP_ENDPOINT = "SPECSERVE_OTLP_TRACES_ENDPOINT"
ENV_SAMPLE_RATIO = "SPECSERVE_TRACE_SAMPLE_RATIO"
OTEL_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
W3C_KEYS = ("traceparent", "tracestate")

Carrier = tuple[tuple[str, str], ...]
_propagator = TraceContextTextMapPropagator()
# The carrier of the work this thread does now (the engine thread's current step): clients of other processes
# (the KV manager's) send it with their calls without changing their signatures.
CURRENT_CARRIER: ContextVar[Carrier] = ContextVar("specserve_trace_carrier", default=())
_configured: dict[str, Any] = {}
_configure_lock = threading.Lock()


@dataclass(frozen=True)
class TracingSettings:
    otlp_endpoint: str | None = None  # e.g. http://127.0.0.1:4317 (gRPC) or http://HOST:4318/v1/traces (HTTP)
    trace_file: str | None = None  # JSON lines, one span per line (appended; several processes may share it)
    sample_ratio: float = 1.0  # of the traces that start here (parent-based: a sampled parent decides)

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in [0, 1], got {self.sample_ratio}")

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint or self.trace_file)

    def env(self) -> dict[str, str]:
        """Environment variables that carry these settings to another process (empty when off)."""
        if not self.enabled:
            return {}
        env = {ENV_SAMPLE_RATIO: repr(self.sample_ratio)}
        if self.otlp_endpoint:
            env[ENV_OTLP_ENDPOINT] = self.otlp_endpoint
        if self.trace_file:
            env[ENV_TRACE_FILE] = os.path.abspath(self.trace_file)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TracingSettings:
        environ = os.environ if environ is None else environ
        endpoint = environ.get(ENV_OTLP_ENDPOINT) or next((environ[v] for v in OTEL_ENDPOINT_VARS if environ.get(v)),
                                                          None)
        return cls(otlp_endpoint=endpoint or None, trace_file=environ.get(ENV_TRACE_FILE) or None,
                   sample_ratio=float(environ.get(ENV_SAMPLE_RATIO, "1.0")))


class JsonLinesSpanExporter(SpanExporter):
    """Each finished span as one JSON object per line (OpenTelemetry's own `to_json`, compacted), appended
    with one `write` per batch so processes sharing the file do not interleave lines."""

    def __init__(self, path: str) -> None:
        self._path = path
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(span.to_json()), separators=(",", ":")) + "\n" for span in spans)
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode("utf-8"))
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def otlp_exporter(endpoint: str) -> SpanExporter:
    """OTLP over HTTP/protobuf for an http(s) URL whose path names /v1/traces (or port 4318); gRPC otherwise."""
    if endpoint.startswith(("http://", "https://")) and ("/v1/traces" in endpoint or ":4318" in endpoint):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        url = endpoint if "/v1/traces" in endpoint else endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=url)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    return GrpcExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))


def configure_tracing(settings: TracingSettings, service: str,
                      exporters: Iterable[SpanExporter] = ()) -> TracerProvider | None:
    """Install this process's tracer provider (once; later calls return the first). None when off and no
    exporter is given. `exporters` adds exporters of the caller's own (tests: an in-memory one)."""
    exporters = list(exporters)
    with _configure_lock:
        if "provider" in _configured:
            return _configured["provider"]
        if not settings.enabled and not exporters:
            return None
        provider = TracerProvider(resource=Resource.create({"service.name": service}),
                                  sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
        if settings.trace_file:
            exporters.append(JsonLinesSpanExporter(settings.trace_file))
        if settings.otlp_endpoint:
            exporters.append(otlp_exporter(settings.otlp_endpoint))
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        trace.set_tracer_provider(provider)
        _configured["provider"] = provider
        return provider


def tracing_enabled() -> bool:
    return "provider" in _configured


def shutdown_tracing() -> None:
    """Flush and stop this process's exporters (end of `specserve generate`, replica shutdown)."""
    provider = _configured.get("provider")
    if provider is not None:
        provider.force_flush()
        provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject(ctx: otel_context.Context | None = None) -> Carrier:
    """The W3C carrier of `ctx` (default: the current context); empty when no span is active."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return tuple((key, carrier[key]) for key in W3C_KEYS if key in carrier)


def extract(carrier: Iterable[tuple[str, str]] | Mapping[str, str] | None) -> otel_context.Context:
    """A context whose parent is the carrier's span (headers and metadata: keys compared case-insensitively)."""
    items = carrier.items() if isinstance(carrier, Mapping) else (carrier or ())
    found = {key.lower(): value for key, value in items if isinstance(key, str) and key.lower() in W3C_KEYS}
    return _propagator.extract(found)


@contextmanager
def worker_span(name: str, carrier: Iterable[tuple[str, str]], requests: int) -> Iterator[trace.Span]:
    """A worker's SERVER span for one batch call, continuing the round's trace from the call's carrier."""
    with tracer().start_as_current_span(name, context=extract(carrier), kind=trace.SpanKind.SERVER,
                                        attributes={"specserve.batch.requests": requests}) as span:
        yield span
