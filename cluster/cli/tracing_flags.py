"""The tracing flags `specserve generate` and `specserve up` share (ClusterConfig's trace fields)."""

from __future__ import annotations

import argparse
from typing import Any


def add_tracing_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tracing (OpenTelemetry; off unless an exporter is named)")
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="export spans to an OTLP collector: HOST:PORT (gRPC) or http(s)://HOST:4318/v1/traces "
                            "(HTTP/protobuf); the OTEL_EXPORTER_OTLP_* variables work as well")
    group.add_argument("--trace-file", default=None, metavar="PATH", help="append every span as a JSON line to PATH")
    group.add_argument("--trace-sample-ratio", type=float, default=None, metavar="R",
                       help="share of new traces sampled, 0..1 (default 1; a caller's traceparent decides for its own)")


def tracing_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ClusterConfig fields the flags set (absent flags leave the config's values)."""
    fields = {"otlp_traces_endpoint": args.otlp_traces_endpoint, "trace_file": args.trace_file,
              "trace_sample_ratio": args.trace_sample_ratio}
    return {key: value for key, value in fields.items() if value is not None}
