"""Every client departure reaches the engine: 100 gRPC streams cancelled back to back, 100 SSE streams dropped.

Each request asks for far more tokens than it lives to see (ignore_eos), so a cancel that did not land would
show as a request running on (live, counted as finished) and as a missing abort.
"""

from __future__ import annotations

import json
from itertools import islice

import requests

from cluster.client import SpecServeClient
from cluster.serving.config import ClusterConfig
from tests.cluster.serving.live_api.helpers import (
    BASE_URL,
    assert_no_leaks,
    scheduler_call,
    wait_aborted,
    wait_idle,
)

STORM = 100
LONG = 200  # tokens asked for; a stream is dropped after its second chunk
PROMPT = "import numpy as np\n\ndef normalize(x):"


def test_100_cancelled_grpc_streams_abort_100_requests(client: SpecServeClient) -> None:
    before = wait_idle()["scheduler"]
    for index in range(STORM):
        stream = client.generate(PROMPT, max_tokens=LONG, ignore_eos=True, k=index % 3,
                                 draft="ngram" if index % 2 else "model", request_id=f"storm-grpc-{index}")
        items = list(islice(stream, 2))
        assert len(items) == 2 and all(item.chunk.finish_reason is None for item in items)
        stream.cancel()  # the next call starts at once: back to back
    wait_aborted(before["aborted"] + STORM)
    after = wait_idle()["scheduler"]
    assert after["aborted"] - before["aborted"] == STORM
    assert after["finished"] == before["finished"], "a cancelled request ran to its end"
    assert_no_leaks()


def test_100_dropped_sse_streams_abort_100_requests(cluster: ClusterConfig) -> None:
    before = wait_idle()["scheduler"]
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    for index in range(STORM):
        with requests.post(f"{BASE_URL}/v1/completions", json={**body, "k": index % 3}, stream=True,
                           timeout=60) as response:
            assert response.status_code == 200
            events = (line for line in response.iter_lines(decode_unicode=True) if line.startswith("data: "))
            lines = list(islice(events, 2))
            assert len(lines) == 2
            assert all(json.loads(line[len("data: "):])["choices"][0]["finish_reason"] is None for line in lines)
        # leaving the `with` closes the connection mid-stream
    wait_aborted(before["aborted"] + STORM)
    after = wait_idle()["scheduler"]
    assert after["aborted"] - before["aborted"] == STORM
    assert after["finished"] == before["finished"], "a dropped request ran to its end"
    assert scheduler_call("health") == (True, "ok")
    assert_no_leaks()
