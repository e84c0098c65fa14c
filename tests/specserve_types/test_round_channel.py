"""The round channel (specserve_types/round_channel.py) without Ray: servers in this process and in a child
process, over the abstract Unix socket and over TCP on loopback."""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import socket
import threading
import time
from typing import Any

import pytest

from model_runtime.compute_thread import ComputeThread
from specserve_types.round_channel import (
    MAX_PENDING_PER_PEER,
    NO_SECRET,
    NONCE_BYTES,
    ChannelLost,
    ChannelServer,
    ChannelTimeout,
    Endpoint,
    PendingPeers,
    RefusalLog,
)
from specserve_types.round_channel_client import ChannelClient, ChannelLink

NODE = "node-a"


class Refused(ValueError):
    pass


def handlers() -> dict[str, Any]:
    def fail(message: str) -> None:
        raise Refused(message)

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compute")
    return {"echo": lambda *args, **kwargs: (args, kwargs), "fail": fail, "sleep": time.sleep,
            "unpicklable": lambda: threading.Lock(),
            "later": lambda x: pool.submit(lambda: (threading.current_thread().name, x)),
            "later_fail": lambda: pool.submit(fail, "later")}


@pytest.fixture(params=["connection-threads", "compute-thread"])
def server(request: pytest.FixtureRequest) -> Any:
    """Each test runs with connections read by their own threads and by a worker's ComputeThread."""
    compute = ComputeThread("test-compute") if request.param == "compute-thread" else None
    srv = ChannelServer(handlers(), NODE, "127.0.0.1", "test", reader=compute)
    srv.start()
    yield srv
    srv.close()
    if compute is not None:
        compute.close()


def test_a_compute_thread_reads_its_connections_runs_the_calls_and_drops_a_closed_one() -> None:
    compute = ComputeThread("test-compute")
    srv = ChannelServer({"where": threading.get_native_id,
                         "queued": lambda: compute.submit(threading.get_native_id)}, NODE, "127.0.0.1", "test",
                        reader=compute)
    try:
        clients = [ChannelClient(srv.start(), NODE) for _ in range(2)]
        for client in clients:
            assert client.call("where") == compute.native_id  # the handler ran on the compute thread
            assert client.call("queued") == compute.native_id  # a future it queued there answers too
        assert compute.call(lambda: len(compute._selector.get_map())) == 3  # the wake pipe + two connections
        clients[0].close()
        deadline = time.monotonic() + 5
        while compute.call(lambda: len(compute._selector.get_map())) != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert compute.call(lambda: len(compute._selector.get_map())) == 2  # the closed one was dropped
        assert clients[1].call("where") == compute.native_id  # the other is served on
        srv.close()  # a closed server ends its watched connections at their next frame
        with pytest.raises(ChannelLost):
            clients[1].call("where")
    finally:
        srv.close()
        compute.close()


@pytest.mark.parametrize("caller_node", [NODE, "node-b"], ids=["unix", "tcp"])
def test_a_call_returns_the_handlers_answer_and_counts_its_time(server: ChannelServer, caller_node: str) -> None:
    client = ChannelClient(server.start(), caller_node)
    family = client._sock.family  # type: ignore[union-attr]
    assert family == (socket.AF_UNIX if caller_node == NODE else socket.AF_INET)
    assert client.call("echo", 1, [2, 3], key="v") == ((1, [2, 3]), {"key": "v"})
    client.call("sleep", 0.05)
    totals = client.totals
    assert totals.calls == 2
    assert totals.handler_seconds >= 0.05
    assert totals.round_trip_seconds >= totals.handler_seconds
    assert 0 <= totals.transport_seconds < totals.round_trip_seconds
    client.close()


def test_a_handlers_exception_is_raised_at_the_caller_and_the_connection_stays(server: ChannelServer) -> None:
    client = ChannelClient(server.start(), NODE)
    with pytest.raises(Refused, match="no"):
        client.call("fail", "no")
    with pytest.raises(AttributeError, match="no method 'missing'"):
        client.call("missing")
    with pytest.raises(RuntimeError, match="unencodable reply"):
        client.call("unpicklable")
    assert client.call("echo", 7) == ((7,), {})  # same connection
    client.close()


def test_a_connection_without_the_secret_is_refused_before_any_frame(server: ChannelServer) -> None:
    endpoint = server.start()
    forged = Endpoint(endpoint.node_id, endpoint.unix_name, endpoint.host, endpoint.port, b"x" * 32,
                      endpoint.instance)
    with pytest.raises(ChannelLost):
        ChannelClient(forged, "node-b").call("echo", 1)
    assert "secret" not in repr(endpoint) and repr(endpoint.secret) not in repr(endpoint)


def test_a_late_reply_times_out_and_closes_the_connection(server: ChannelServer) -> None:
    client = ChannelClient(server.start(), NODE)
    with pytest.raises(ChannelTimeout):
        client.call("sleep", 1.0, timeout_s=0.1)
    assert not client.connected
    with pytest.raises(ChannelLost, match="closed"):
        client.call("echo", 1)


def _serve_in_child(endpoints: Any) -> None:
    server = ChannelServer(handlers(), NODE, "127.0.0.1", "child")
    endpoints.put(server.start())
    time.sleep(600)


def test_a_killed_worker_is_a_lost_channel_and_the_link_reconnects_to_its_replacement() -> None:
    ctx = multiprocessing.get_context("spawn")
    endpoints = ctx.Queue()
    children = []

    def resolve() -> Endpoint:  # "ask Ray": the live worker's endpoint (a replacement after a kill)
        if not children or not children[-1].is_alive():
            child = ctx.Process(target=_serve_in_child, args=(endpoints,), daemon=True)
            child.start()
            children.append(child)
            resolve.endpoint = endpoints.get(timeout=60)  # type: ignore[attr-defined]
        return resolve.endpoint  # type: ignore[attr-defined]

    link = ChannelLink(resolve, NODE)
    try:
        assert link.call("echo", "a") == (("a",), {})
        first = resolve.endpoint  # type: ignore[attr-defined]
        children[-1].kill()
        children[-1].join(10)
        with pytest.raises(ChannelLost):
            link.call("echo", "b")
        assert link.call("echo", "c") == (("c",), {})  # a new worker, a new endpoint
        assert resolve.endpoint.instance != first.instance  # type: ignore[attr-defined]
        assert link.connects == 2
        assert link.totals().calls == 2  # the two answered calls, over both connections
    finally:
        link.close()
        for child in children:
            child.kill()


def test_calls_from_many_threads_each_get_their_own_answer(server: ChannelServer) -> None:
    link = ChannelLink(server.start, NODE)
    answers: dict[int, Any] = {}

    def worker(i: int) -> None:
        answers[i] = [link.call("echo", i, j) for j in range(20)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == {i: [((i, j), {}) for j in range(20)] for i in range(8)}
    assert link.totals().calls == 160
    link.close()


def test_a_future_answer_is_sent_when_it_completes(server: ChannelServer) -> None:
    client = ChannelClient(server.start(), NODE)
    name, value = client.call("later", 5)
    assert name.startswith("compute") and value == 5
    with pytest.raises(Refused, match="later"):
        client.call("later_fail")
    assert client.call("echo", 1) == ((1,), {})
    client.close()


def test_a_sent_call_is_answered_by_its_result_and_holds_the_client_until_then(server: ChannelServer) -> None:
    client = ChannelClient(server.start(), NODE)
    pending = client.send("sleep", 0.05)
    other: list[Any] = []
    caller = threading.Thread(target=lambda: other.append(client.call("echo", "after")))
    caller.start()
    caller.join(0.02)
    assert caller.is_alive() and not other  # the client is the pending call's until its answer is read
    assert pending.result() is None and pending.result() is None  # read once, kept
    caller.join(5)
    assert other == [(("after",), {})]
    failing = client.send("fail", "no")
    with pytest.raises(Refused):
        failing.result()
    assert client.call("echo", 1) == ((1,), {}) and client.totals.calls == 4


# -- connections that never prove the secret ------------------------------------------------------------------
def _raw(endpoint: Endpoint, unix: bool = False) -> socket.socket:
    if unix:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect("\0" + str(endpoint.unix_name))
    else:
        sock = socket.create_connection((endpoint.host, endpoint.port))
    sock.settimeout(5)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed it (after its nonce, if it sent one)."""
    data = b""
    while True:
        more = sock.recv(64)
        if not more:
            return True
        data += more
        assert len(data) <= NONCE_BYTES


def _wait(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_a_peers_unauthenticated_connections_are_capped_and_dropped_after_the_timeout(
        unix: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Twenty raw connections that never answer the nonce: MAX_PENDING_PER_PEER get a nonce and a thread, the rest are
    closed at once; the idle ones are closed after the handshake timeout; then a caller is served. Each kind of
    refusal logs one line (rate-limited)."""
    srv = ChannelServer({"echo": lambda x: x}, NODE, "127.0.0.1", "capped")
    srv.handshake_timeout_s = 1.0
    endpoint = srv.start()
    peer = f"uid {os.getuid()}" if unix else "127.0.0.1"
    threads_before = threading.active_count()
    try:
        with caplog.at_level(logging.WARNING, "specserve.channel"):
            started = time.monotonic()
            socks = [_raw(endpoint, unix) for _ in range(20)]
            nonces = []
            for sock in socks:  # a pending one gets its nonce; one over the cap is closed without it
                try:
                    nonces.append(len(sock.recv(NONCE_BYTES, socket.MSG_WAITALL)))
                except ConnectionResetError:
                    nonces.append(0)
            assert nonces.count(NONCE_BYTES) == MAX_PENDING_PER_PEER
            assert srv.pending.pending(peer) == MAX_PENDING_PER_PEER
            assert threading.active_count() - threads_before <= MAX_PENDING_PER_PEER
            assert all(_closed_by_server(sock) for sock in socks)  # the idle ones after the timeout
            assert 1.0 <= time.monotonic() - started < 4.0
            _wait(lambda: srv.pending.pending(peer) == 0)
        refusals = [r.getMessage() for r in caplog.records if r.name == "specserve.channel"]
        assert len(refusals) == 2, refusals  # 12 over the cap, 8 timed out: one line each kind
        assert any("already wait for their handshake" in line for line in refusals)
        assert any("no answer to the nonce within 1s" in line for line in refusals)
        assert srv.refusals.total == 20
        client = ChannelClient(endpoint, NODE if unix else "node-b")
        assert client.call("echo", 5) == 5  # the peer's caller is served again
        assert srv.pending.pending(peer) == 0  # an authenticated connection is not pending
        client.close()
    finally:
        for sock in socks:
            sock.close()
        srv.close()


def test_a_wrong_answer_and_a_hangup_are_refused_and_release_their_slot() -> None:
    srv = ChannelServer({"echo": lambda x: x}, NODE, "127.0.0.1", "wrong")
    endpoint = srv.start()
    try:
        for answer in (b"x" * 32, b""):
            sock = _raw(endpoint)
            assert len(sock.recv(NONCE_BYTES, socket.MSG_WAITALL)) == NONCE_BYTES
            if answer:
                sock.sendall(answer)
            else:
                sock.shutdown(socket.SHUT_WR)
            assert _closed_by_server(sock)
            sock.close()
        _wait(lambda: srv.refusals.total == 2)
        assert srv.pending.pending("127.0.0.1") == 0
    finally:
        srv.close()


def test_refusal_lines_are_rate_limited_per_kind() -> None:
    lines: list[str] = []
    logger = logging.getLogger("test.refusals")
    logger.addHandler(handler := _ListHandler(lines))
    now = [0.0]
    refusals = RefusalLog(logger, "x channel", window_s=10.0, clock=lambda: now[0])
    try:
        assert refusals.refused("10.0.0.1", NO_SECRET)
        assert not any(refusals.refused(f"10.0.0.{i}", NO_SECRET) for i in range(50))
        assert refusals.refused("10.0.0.1", "another kind")
        now[0] = 10.0
        assert refusals.refused("10.0.0.9", NO_SECRET)
    finally:
        logger.removeHandler(handler)
    assert len(lines) == 3 and refusals.total == 53
    assert lines[2] == ("x channel: a connection from 10.0.0.9 refused: it did not prove the secret "
                        "(+50 like it suppressed in the last 10s)")


class _ListHandler(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_pending_peers_count_each_peer_apart() -> None:
    pending = PendingPeers(cap=2)
    assert pending.admit("a") and pending.admit("a") and not pending.admit("a") and pending.admit("b")
    pending.release("a")
    assert pending.admit("a") and pending.pending("a") == 2
    for _ in range(3):
        pending.release("a")
    assert pending.pending("a") == 0 and pending._counts == {"b": 1}
