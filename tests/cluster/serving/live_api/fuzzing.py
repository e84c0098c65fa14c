"""schemathesis over the OpenAI routes' schema: every operation, positive and negative data, bounded examples.

Used by live_api/test_http_fuzz.py (the live cluster, through its /openapi.json) and by
tests/cluster/serving/test_http_api.py (the same routes over a scripted scheduler, no Ray).

Checks: not_a_server_error (no 5xx), status_code_conformance and content_type_conformance (only documented
codes and media types), response_schema_conformance (bodies and each SSE event match their models), and
negative_data_rejection (schema-invalid bodies answer 4xx). Generation is derandomized (the same examples every
run). Positive cases are kept short (max_tokens, max_completion_tokens <= SHORT_TOKENS, n <= SHORT_N) because
the schema, rightly, allows 8192 tokens and 16 completions, and every other one that leaves `stream` unset is
streamed (hypothesis seldom sets one of ~35 optional fields, and SSE events have their own schema); negative
cases are sent as generated (they are refused before generating anything).
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.schemas import APIOperation, BaseSchema
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
SHORT_TOKENS = 4
SHORT_N = 2


def keep_short(case: Case, stream: bool) -> None:
    """Bound a positive case's generation, and stream it if `stream` and it does not say (it stays schema-valid)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if body.get("stream") is None and (stream or body.get("stream_options") is not None):
        body["stream"] = True  # hypothesis seldom draws one of 35 optional fields: half the cases stream
    body["max_tokens"] = min(body.get("max_tokens") or SHORT_TOKENS, SHORT_TOKENS)
    if body.get("max_completion_tokens") is not None:
        body["max_completion_tokens"] = min(body["max_completion_tokens"], SHORT_TOKENS)
    if body.get("n") is not None:
        body["n"] = min(body["n"], SHORT_N)


def fuzz_operation(operation: APIOperation, mode: GenerationMode, max_examples: int, seen: dict[str, int],
                   call: dict[str, Any]) -> None:
    """`max_examples` cases of `operation` in `mode`, each sent and checked; counts them in `seen[mode]`."""

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Case) -> None:
        if mode is GenerationMode.POSITIVE:
            keep_short(case, stream=seen[mode.value] % 2 == 1)
        response = case.call(**call)
        case.validate_response(response, checks=CHECKS)
        seen[mode.value] += 1

    run()


def fuzz_schema(schema: BaseSchema, max_examples: int, **call: Any) -> dict[str, dict[str, int]]:
    """Run every operation of `schema` (negative data only where there is a body); `call` goes to
    `case.call` (base_url, timeout). Raises the first failure; returns {operation: {mode: cases run}}."""
    counts: dict[str, dict[str, int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        seen = counts.setdefault(operation.label, {"positive": 0, "negative": 0})
        fuzz_operation(operation, GenerationMode.POSITIVE, max_examples, seen, call)
        if operation.method.upper() == "POST":
            fuzz_operation(operation, GenerationMode.NEGATIVE, max_examples, seen, call)
    return counts
