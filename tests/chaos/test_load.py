"""The chaos load generator's verdict on HTTP streams that break: a server that dies mid-response (a killed
proxy) and an in-band error event (a scheduler that died) end as typed errors (UNAVAILABLE), never as an
untyped client error or INTERNAL that the invariants count as lost."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from chaos.load import LoadGenerator, LoadSettings, RequestRecord, RequestSpec

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
TOKEN = b'data: {"choices": [{"text": "x", "finish_reason": null}], "specserve": {"token_ids": [5]}}\n\n'
ERROR = b"data: " + json.dumps({"error": {"message": "scheduler unavailable; retry", "type": "unavailable_error",
                                          "param": None, "code": None}}).encode() + b"\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.fixture
def server() -> Iterator[Callable[[bytes], int]]:
    """server(reply) -> port: answers one request with `reply` (raw bytes), then closes the connection."""
    threads: list[threading.Thread] = []
    listeners: list[socket.socket] = []

    def start(reply: bytes) -> int:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        threads.append(thread)
        listeners.append(listener)
        return listener.getsockname()[1]

    yield start
    for thread in threads:
        thread.join(5)
    for listener in listeners:
        listener.close()


def one_http_request(port: int) -> RequestRecord:
    spec = RequestSpec("g3", "prompt", 4, "http")
    load = LoadGenerator("127.0.0.1:1", f"http://127.0.0.1:{port}", "m", [spec], LoadSettings(deadline_s=10))
    return load._one(spec, plain=True)


def test_a_stream_cut_mid_response_is_unavailable(server: Callable[[bytes], int]) -> None:
    record = one_http_request(server(HEAD + chunk(TOKEN) + b"40\r\npartial"))  # a chunk cut short: the server died
    assert record.outcome == "UNAVAILABLE", (record.outcome, record.detail)
    assert record.tokens == [5]


def test_an_in_band_unavailable_error_is_unavailable(server: Callable[[bytes], int]) -> None:
    record = one_http_request(server(HEAD + chunk(TOKEN) + chunk(ERROR) + b"0\r\n\r\n"))
    assert record.outcome == "UNAVAILABLE", (record.outcome, record.detail)
    assert record.tokens == [5]
