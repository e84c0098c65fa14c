"""Tracing settings, exporters and W3C carriers (specserve_types/tracing.py), without a collector."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from specserve_types.tracing import (
    ENV_TRACE_FILE,
    JsonLinesSpanExporter,
    TracingSettings,
    extract,
    inject,
    otlp_exporter,
)


def test_settings_travel_through_the_environment(tmp_path: Path) -> None:
    settings = TracingSettings(otlp_endpoint="127.0.0.1:4317", trace_file=str(tmp_path / "s.jsonl"), sample_ratio=0.25)
    assert TracingSettings.from_env(settings.env()) == settings
    assert TracingSettings().env() == {} and not TracingSettings().enabled
    standard = TracingSettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert standard.otlp_endpoint == "http://collector:4318" and standard.enabled
    assert TracingSettings.from_env({ENV_TRACE_FILE: "x.jsonl"}).sample_ratio == 1.0
    with pytest.raises(ValueError):
        TracingSettings(sample_ratio=1.5)


def test_the_otlp_protocol_follows_the_endpoint() -> None:
    assert isinstance(otlp_exporter("127.0.0.1:4317"), GrpcExporter)
    assert isinstance(otlp_exporter("http://127.0.0.1:4317"), GrpcExporter)
    assert isinstance(otlp_exporter("http://127.0.0.1:4318"), HttpExporter)
    assert isinstance(otlp_exporter("https://collector.example/v1/traces"), HttpExporter)


def test_json_lines_exporter_writes_one_span_per_line(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "spans.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(str(path))))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("parent") as parent:
        carrier = inject()
        with tracer.start_as_current_span("child"):
            pass
    lines = path.read_text().splitlines()
    spans = {json.loads(line)["name"]: json.loads(line) for line in lines}
    assert len(lines) == 2 and spans["child"]["parent_id"] == spans["parent"]["context"]["span_id"]
    trace_id = f"{parent.get_span_context().trace_id:032x}"
    assert dict(carrier)["traceparent"].split("-")[1] == trace_id
    # carriers compare keys case-insensitively (HTTP headers, environment variables)
    context = extract({"TRACEPARENT": dict(carrier)["traceparent"]})
    with tracer.start_as_current_span("continued", context=context) as continued:
        assert continued.get_span_context().trace_id == parent.get_span_context().trace_id
    assert inject(extract(())) == ()
    provider.shutdown()
