"""One request traced through the cluster: the client's traceparent (gRPC metadata) is the parent of the
ingress's SERVER span, whose trace holds one speculative_round per round (from the scheduler's process) with
the batch's phase spans, and attribute values equal to the response's statistics. The cluster writes its
spans to a JSON-lines file (`trace_file`, conftest.py)."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import grpc
import requests

from cluster.client import build_request
from cluster.serving.config import ClusterConfig
from specserve_types.proto import specserve_pb2_grpc
from specserve_types.protocol import chunk_from_proto

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" \
         "def fibonacci(n):"
PHASES = {"kv.reserve", "verify.forward", "accept", "kv.commit", "emit"}


def spans_of(trace_file: Path, trace_id: str, rounds: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The spans of one trace once its SERVER span and `rounds` round spans were exported (each process
    exports in batches: they arrive late and in any order)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [span for line in trace_file.read_text().splitlines() if (span := json.loads(line))
                 and span["context"]["trace_id"] == f"0x{trace_id}"] if trace_file.exists() else []
        servers = sum(span["kind"] == "SpanKind.SERVER" and span["parent_id"] is not None
                      and span["name"] in ("text_completion smollm2-135m", "chat smollm2-135m") for span in spans)
        round_spans = sum(span["name"] == "speculative_round" for span in spans)
        verifies = sum(span["name"] == "verifier.verify" for span in spans)
        if (servers and round_spans >= rounds and verifies >= rounds) or time.monotonic() > deadline:
            time.sleep(1.0)  # the last round's phase spans travel in the same batch or the next
            return [span for line in trace_file.read_text().splitlines() if (span := json.loads(line))
                    and span["context"]["trace_id"] == f"0x{trace_id}"]
        time.sleep(0.25)


def test_a_grpc_request_is_one_trace_from_the_clients_span(cluster: ClusterConfig, trace_file: Path) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    metadata = (("traceparent", f"00-{trace_id}-{client_span}-01"),)
    request = build_request(PROMPT, max_tokens=16, k=3, draft="model", ignore_eos=True, request_id="traced-1")
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        chunks = [chunk_from_proto(c).chunk for c in
                  specserve_pb2_grpc.SpecServeStub(channel).Generate(request, metadata=metadata, timeout=120)]
    stats = chunks[-1].stats
    assert stats is not None and stats["output_tokens"] == 16

    spans = spans_of(trace_file, trace_id, rounds=stats["rounds"])
    servers = [s for s in spans if s["kind"] == "SpanKind.SERVER" and s["name"] == "text_completion smollm2-135m"]
    assert len(servers) == 1, sorted({(s["name"], s["kind"], s["resource"]["attributes"]["service.name"])
                                      for s in spans})
    (server,) = servers
    assert server["name"] == "text_completion smollm2-135m" and server["parent_id"] == f"0x{client_span}"
    assert server["resource"]["attributes"]["service.name"] == "specserve-ingress"
    attributes = server["attributes"]
    assert attributes["gen_ai.usage.output_tokens"] == 16 and attributes["gen_ai.response.id"] == "traced-1"
    assert attributes["gen_ai.latency.time_to_first_token"] == stats["ttft_seconds"]
    spec = stats["speculative_decoding"]
    assert attributes["specserve.speculative_decoding.num_draft_tokens"] == spec["num_draft_tokens"]

    rounds = [s for s in spans if s["name"] == "speculative_round"]
    assert len(rounds) == stats["rounds"] == len(chunks)
    assert all(s["parent_id"] == server["context"]["span_id"] for s in rounds)
    assert {s["resource"]["attributes"]["service.name"] for s in rounds} == {"specserve-scheduler"}
    rounds.sort(key=lambda s: s["start_time"])
    for round_span, chunk in zip(rounds, chunks, strict=True):
        assert round_span["attributes"]["specserve.round.drafts_proposed"] == chunk.proposed
        assert round_span["attributes"]["specserve.round.drafts_accepted"] == chunk.accepted
        assert round_span["attributes"]["specserve.round.tokens_emitted"] == len(chunk.token_ids)
        phases = {s["name"] for s in spans if s["parent_id"] == round_span["context"]["span_id"]}
        assert PHASES <= phases, phases
    assert sum(s["attributes"]["specserve.round.drafts_accepted"] for s in rounds) == spec["num_accepted_draft_tokens"]
    # the trace continues in the worker processes: their SERVER spans are children of the rounds they served
    round_ids = {s["context"]["span_id"] for s in rounds}
    for name, service in (("verifier.verify", "specserve-verifier"), ("drafter.propose", "specserve-drafter")):
        workers = [s for s in spans if s["name"] == name]
        assert workers and all(s["parent_id"] in round_ids for s in workers), (name, len(workers))
        assert {s["resource"]["attributes"]["service.name"] for s in workers} == {service}
    assert len([s for s in spans if s["name"] == "verifier.verify"]) == len(rounds)
    ledger = [s for s in spans if s["resource"]["attributes"]["service.name"] == "specserve-kv-manager"]
    assert ledger and all(s["parent_id"] in round_ids for s in ledger)
    assert {s["name"] for s in ledger} <= {"kv.reserve", "kv.commit", "kv.commit_then_reserve"}


def test_an_http_request_continues_the_callers_trace(cluster: ClusterConfig, trace_file: Path) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    response = requests.post(f"http://127.0.0.1:{cluster.http_port}/v1/chat/completions", timeout=120,
                             headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
                             json={"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 8,
                                   "k": 2, "draft": "ngram"})
    assert response.status_code == 200, response.text
    (stats,) = response.json()["specserve"]["stats"]
    spans = spans_of(trace_file, trace_id, rounds=stats["rounds"])
    assert sum(s["name"] == "verifier.verify" for s in spans) == stats["rounds"]
    # Serve's proxy/ASGI layer may add its own SERVER span ("POST /v1/chat/completions") beside ours
    (server,) = [s for s in spans if s["kind"] == "SpanKind.SERVER" and s["name"] == "chat smollm2-135m"]
    assert server["parent_id"] == f"0x{client_span}"
    assert server["attributes"]["gen_ai.response.id"] == response.headers["x-specserve-request-id"]
    assert server["attributes"]["gen_ai.usage.output_tokens"] == stats["output_tokens"]
    assert sum(s["name"] == "speculative_round" for s in spans) == stats["rounds"]
