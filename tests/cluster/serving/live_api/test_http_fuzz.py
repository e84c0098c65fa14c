"""The issue's 5xx reproductions as raw HTTP, then schemathesis against the live HTTP API, driven by the cluster's own /openapi.json (live_api/fuzzing.py):
every operation with positive and negative data, bounded examples; no 5xx, only documented status codes and
media types, bodies and SSE events matching their models, invalid bodies refused with a 4xx; and the constraint
fields' fuzzer (fuzzing.fuzz_constraints: response_format, structured_outputs, guided_*, logit_bias, tools in every
request, compiled by the real engine): a 200 or a 400 naming a field. Then the server is healthy, no request failed
inside the scheduler, and no KV is leaked.
Run inside the loopback-only namespace (scripts/in-netns.sh).
"""

from __future__ import annotations

import time

import pytest
import requests
import schemathesis

from cluster.serving.config import ClusterConfig
from tests.cluster.serving.live_api.fuzzing import fuzz_constraints, fuzz_schema
from tests.cluster.serving.live_api.helpers import BASE_URL, assert_no_leaks, http, scheduler_call

pytestmark = pytest.mark.timeout(600)

MAX_EXAMPLES = 40  # per operation and mode: ~2 x 2 x 40 generation requests, of at most 4 tokens each
CONSTRAINED_EXAMPLES = 120  # requests with constraint fields, of at most 4 tokens each


def test_schemathesis_finds_nothing(cluster: ClusterConfig) -> None:
    errored_before = scheduler_call("stats")["scheduler"]["errored"]
    schema = schemathesis.openapi.from_url(f"{BASE_URL}/openapi.json")
    started = time.monotonic()
    counts = fuzz_schema(schema, max_examples=MAX_EXAMPLES, base_url=BASE_URL, timeout=60)
    elapsed = time.monotonic() - started
    print(f"schemathesis: {counts} in {elapsed:.1f}s")
    for route in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert counts[route]["positive"] >= MAX_EXAMPLES // 2 and counts[route]["negative"] >= MAX_EXAMPLES // 2
    assert {"GET /v1/models", "GET /health", "GET /v1/stats"} <= set(counts)
    assert http("/health").json() == {"status": "ok"}
    assert scheduler_call("stats")["scheduler"]["errored"] == errored_before
    assert_no_leaks()


def test_the_constraint_fields_fuzzed(cluster: ClusterConfig) -> None:
    errored_before = scheduler_call("stats")["scheduler"]["errored"]
    seen = fuzz_constraints(lambda path, body: requests.post(f"{BASE_URL}{path}", json=body, timeout=60),
                            max_examples=CONSTRAINED_EXAMPLES)
    print(f"constraint fields: {seen}")
    assert seen.get("200", 0) > CONSTRAINED_EXAMPLES // 4 and seen.get("400", 0) > CONSTRAINED_EXAMPLES // 10, seen
    assert http("/health").json() == {"status": "ok"}
    assert scheduler_call("stats")["scheduler"]["errored"] == errored_before
    assert_no_leaks()


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", r'{"prompt": "abc\ud800def", "max_tokens": 4}', "prompt"),
        ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "abc\ud800def"}], "max_tokens": 4}',
         "messages[0].content"),
        ("/v1/completions", "[" * 100_000 + "]" * 100_000, "body"),
        ("/v1/completions", '{"prompt": "' + "x" * (8 << 20) + '"}', "body"),  # 8 MiB: 413
    ],
)
def test_what_answered_500_is_refused(cluster: ClusterConfig, path: str, raw: str, param: str) -> None:
    response = requests.post(f"{BASE_URL}{path}", data=raw.encode(), timeout=60,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == (413 if len(raw) > 8 << 20 else 400), response.text[:200]
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and error["type"] == "invalid_request_error"
