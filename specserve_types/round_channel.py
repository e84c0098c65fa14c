"""The round's transport: one socket per (caller, worker), one framed request and reply per call.

    engine thread                                   worker process (a Serve replica, the KV actor)
    -------------                                   ----------------------------------------------
    ChannelClient.call("verify", batch)  --frame-->  the worker's ComputeThread (the KV actor: a connection thread)
         blocks on recv                 <--frame--   handlers["verify"](batch) -> the forward, then the reply

Why not Serve's router or a Ray actor call for the hot path: each costs 1-10 ms on a busy CPU node (a router
hop, the core worker's gRPC, an event loop's turn); a blocking socket between two threads costs tens of
microseconds. Ray still places, health-checks and replaces the workers, and hands out the endpoint: a caller
asks the worker for its `Endpoint` through Ray (`channel()`), connects, and asks again only after the
connection broke (a replaced worker has a new endpoint). vLLM made the same choice for its workers (a
shared-memory / ZeroMQ message queue instead of Ray's Compiled Graphs, RFC vllm#35848); Compiled Graphs cannot
bind a Serve replica's methods, and the verifier and drafter stay Serve deployments.

Same node (same Ray node id): a Linux abstract Unix socket, else TCP on the worker node's address with
TCP_NODELAY. Every connection proves it holds the endpoint's secret (HMAC-SHA256 of a server nonce) before any
frame is decoded; the secret travels only inside Ray. A frame is a length, a kind and a payload: the round's hot
methods (`verify`, `propose`) as typed MessagePack, everything else a pickle (specserve_types/round_codec.py).

A call's reply carries the handler's own seconds, so a client knows its transport's own time: round trip minus
handler (`ChannelTotals`). Failures: a broken connection raises `ChannelLost` (a ConnectionError), a reply
later than the timeout `ChannelTimeout` (a TimeoutError); either closes the connection (the caller connects
again, through Ray, on its next call). An exception raised by the handler is raised at the caller as it is.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from specserve_types.round_codec import (
    FRAME_HEADER,
    CallFrame,
    decode_answer,
    encode_answer,
    encode_call,
)

log = logging.getLogger("specserve.channel")

NONCE_BYTES = 32
MAX_FRAME = 1 << 34  # 16 GiB: a sanity bound on a length read off the wire

Handler = Callable[..., Any]  # blocking; runs on the channel's connection thread (or its FrameReader's)
FRAME_TIMEOUT_S = 10.0  # a watched connection's frame: its rest is due within this once its first bytes are in


class FrameReader(Protocol):
    """A thread that reads connections itself (a worker's ComputeThread, model_runtime/compute_thread.py):
    `watch` calls `on_readable()` on that thread whenever the socket has data, until it raises."""

    def watch(self, sock: socket.socket, on_readable: Callable[[], None]) -> None: ...


class ChannelLost(ConnectionError):
    """The connection broke (the worker died, was replaced, or refused the credentials)."""


class ChannelTimeout(TimeoutError):
    """No reply within the call's timeout; the connection is closed (its late reply is never read)."""


@dataclass(frozen=True)
class Endpoint:
    """Where a worker's channel listens; handed out only through Ray (it holds the secret)."""

    node_id: str  # the worker's Ray node: a caller on the same node connects through the Unix socket
    unix_name: str | None  # abstract socket name (Linux), None where there is none
    host: str
    port: int
    secret: bytes
    instance: str  # the server's id: a new one after a restart

    def __repr__(self) -> str:  # never print the secret
        return f"Endpoint(node={self.node_id[:8]}, unix={self.unix_name!r}, tcp={self.host}:{self.port})"


@dataclass
class ChannelTotals:
    """One client's calls: the round trip as the caller saw it, and the handler's part of it."""

    calls: int = 0
    round_trip_seconds: float = 0.0
    handler_seconds: float = 0.0

    def __add__(self, other: ChannelTotals) -> ChannelTotals:
        return ChannelTotals(self.calls + other.calls, self.round_trip_seconds + other.round_trip_seconds,
                             self.handler_seconds + other.handler_seconds)

    @property
    def transport_seconds(self) -> float:
        return self.round_trip_seconds - self.handler_seconds

    def to_dict(self) -> dict[str, float]:
        return {"calls": self.calls, "round_trip_seconds": self.round_trip_seconds,
                "handler_seconds": self.handler_seconds, "transport_seconds": self.transport_seconds}


def _digest(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


class ChannelServer:
    """Serves `handlers`: one listener thread per socket; each connection read by a thread of its own, or, given a
    `reader`, by that thread (the verifier's and drafter's ComputeThread: the request wakes the thread that runs
    it, with no hand-off between two threads on the round's path). Calls on a connection run one after another
    (a caller's calls are serial anyway). A handler answers with a value, or with a `concurrent.futures.Future`
    whose done-callback sends the reply from the thread that completes it (the verifier's and drafter's: their
    ComputeThread sends the answer as the forward ends). A handler is responsible for its own synchronization
    with the rest of its process (the verifier's and drafter's queue their work on the ComputeThread and never
    block it; the KV manager's take the ledger's lock)."""

    def __init__(self, handlers: Mapping[str, Handler], node_id: str, host: str, name: str,
                 reader: FrameReader | None = None) -> None:
        self.handlers = dict(handlers)
        self.reader = reader
        self.node_id = node_id
        self.host = host
        self.name = name
        self.secret = secrets.token_bytes(32)
        self.instance = secrets.token_hex(8)
        self.endpoint: Endpoint | None = None
        self._listeners: list[socket.socket] = []
        self._closed = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> Endpoint:
        """Listen (idempotent, thread-safe) and return the endpoint."""
        with self._lock:
            if self.endpoint is not None:
                return self.endpoint
            tcp = socket.create_server((self.host, 0), backlog=64)
            self._listeners.append(tcp)
            port = tcp.getsockname()[1]
            unix_name: str | None = None
            if os.uname().sysname == "Linux":  # an abstract socket: no file to clean up, scoped to the netns
                unix_name = f"specserve-{self.name}-{os.getpid()}-{self.instance}"
                unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                unix.bind("\0" + unix_name)
                unix.listen(64)
                self._listeners.append(unix)
            for listener in self._listeners:
                threading.Thread(target=self._accept, args=(listener,), name=f"{self.name}-channel-accept",
                                 daemon=True).start()
            self.endpoint = Endpoint(self.node_id, unix_name, self.host, port, self.secret, self.instance)
        log.info("%s channel listening: %r", self.name, self.endpoint)
        return self.endpoint

    def close(self) -> None:
        self._closed.set()
        for listener in self._listeners:
            listener.close()
        self._listeners = []

    def _accept(self, listener: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name=f"{self.name}-channel", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        adopted = False  # handed to the reader, which closes it
        try:
            conn.settimeout(10.0)
            nonce = secrets.token_bytes(NONCE_BYTES)
            conn.sendall(nonce)
            if not hmac.compare_digest(_recv_exact(conn, 32), _digest(self.secret, nonce)):
                log.warning("%s channel: a connection without the secret was refused", self.name)
                return
            conn.sendall(b"\1")
            if self.reader is not None:  # the worker's compute thread reads this connection's frames itself
                conn.settimeout(FRAME_TIMEOUT_S)  # a frame's rest, once its first bytes are in
                self.reader.watch(conn, lambda: self._read_frame(conn))
                adopted = True
                return
            conn.settimeout(None)
            while not self._closed.is_set():
                self._read_frame(conn)
        except OSError:
            pass  # the caller went away (ChannelLost included)
        finally:
            if not adopted:
                conn.close()

    def _read_frame(self, conn: socket.socket) -> None:
        """Read one call off the connection and answer it (raises OSError once the connection is done)."""
        if self._closed.is_set():
            raise ChannelLost("the server closed")
        self._answer(conn, CallFrame(*_recv_frame(conn)))

    def _answer(self, conn: socket.socket, call: CallFrame) -> None:
        start = time.perf_counter()
        call_id, method = call.call_id, call.method
        try:
            handler = self.handlers.get(method)
            if handler is None:
                raise AttributeError(f"{self.name} channel has no method {method!r}")
            args, kwargs = call.arguments()  # a typed frame's are validated here: an error goes back to the caller
            value = handler(*args, **kwargs)
        except Exception as exc:  # raised at the caller, as a Serve or actor call would
            _reply(conn, call_id, method, False, exc, start)
            return
        if isinstance(value, concurrent.futures.Future):
            value.add_done_callback(lambda done: _reply(conn, call_id, method, *_outcome(done), start))
        else:
            _reply(conn, call_id, method, True, value, start)


def _outcome(done: concurrent.futures.Future[Any]) -> tuple[bool, Any]:
    exc = done.exception()
    return (True, done.result()) if exc is None else (False, exc)


def _reply(conn: socket.socket, call_id: int, method: str, ok: bool, value: Any, start: float) -> None:
    """Send a call's answer (on the connection's thread, or the thread that completed a handler's future)."""
    seconds = time.perf_counter() - start
    try:
        frame = encode_answer(call_id, method, ok, value, seconds)
    except Exception as exc:  # an answer or exception that neither codec can encode
        frame = encode_answer(call_id, method, False, RuntimeError(f"{method}: unencodable reply: {exc!r}"), seconds)
    try:
        conn.sendall(frame)
    except OSError:
        pass  # the caller went away: its connection thread ends on its next read


def _recv_frame(sock: socket.socket) -> tuple[int, bytearray]:
    """One frame's kind and payload (round_codec.py); ChannelLost for a length no frame has."""
    length, kind = FRAME_HEADER.unpack(_recv_exact(sock, FRAME_HEADER.size))
    if not 1 <= length <= MAX_FRAME:
        log.warning("channel: a %d-byte frame refused", length)
        raise ChannelLost(f"a {length}-byte frame")
    return kind, _recv_exact(sock, length - 1)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    """`n` bytes, read into one buffer (no copy: the codecs, struct and hmac read it as it is)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ChannelLost("connection closed by the other side")
        got += k
    return buf


class ChannelClient:
    """A blocking client of one endpoint; thread-safe (one call at a time). Owner of its socket and totals."""

    def __init__(self, endpoint: Endpoint, local_node_id: str | None, connect_timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.totals = ChannelTotals()
        self._lock = threading.Lock()
        self._next_id = 0
        self._sock: socket.socket | None = self._connect(local_node_id, connect_timeout_s)
        self._sock.settimeout(None)
        self._timeout_s: float | None = None  # the socket's current timeout (set only when a call's differs)

    def _connect(self, local_node_id: str | None, timeout_s: float) -> socket.socket:
        ep = self.endpoint
        try:
            if ep.unix_name is not None and local_node_id == ep.node_id:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout_s)
                sock.connect("\0" + ep.unix_name)
            else:
                sock = socket.create_connection((ep.host, ep.port), timeout=timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = _recv_exact(sock, NONCE_BYTES)
            sock.sendall(_digest(ep.secret, nonce))
            _recv_exact(sock, 1)
        except OSError as exc:
            raise ChannelLost(f"cannot connect to {ep!r}: {exc}") from exc
        return sock

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def call(self, method: str, *args: Any, timeout_s: float | None = None,
             on_sent: Callable[[], None] | None = None, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` on the worker; `on_sent()` runs once the request is on its way, before the
        wait for the answer (the caller's other work overlaps the worker's)."""
        pending = self.send(method, *args, timeout_s=timeout_s, **kwargs)
        if on_sent is not None:
            try:
                on_sent()
            except BaseException:
                pending.result()  # the answer is read whatever the hook did (the connection stays in step)
                raise
        return pending.result()

    def send(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> PendingCall:
        """Send the call and return at once; the client is this call's until its `result()` is read (which it
        must be: other calls wait for it)."""
        self._lock.acquire()
        try:
            sock = self._sock
            if sock is None:
                raise ChannelLost(f"channel to {self.endpoint!r} is closed")
            self._next_id += 1
            start = time.perf_counter()
            try:
                if timeout_s != self._timeout_s:
                    sock.settimeout(timeout_s)
                    self._timeout_s = timeout_s
                sock.sendall(encode_call(self._next_id, method, args, kwargs))
            except OSError as exc:
                self._close_locked()
                raise ChannelLost(f"{method}: {exc}") from exc
        except BaseException:
            self._lock.release()
            raise
        return PendingCall(self, self._next_id, method, start, timeout_s)

    def _receive(self, pending: PendingCall) -> tuple[bool, Any]:
        """The answer of the call `pending` sent (the lock `send` took is released here)."""
        try:
            sock = self._sock
            if sock is None:
                raise ChannelLost(f"{pending.method}: the connection closed before its answer")
            method = pending.method
            try:
                kind, payload = _recv_frame(sock)
            except TimeoutError as exc:
                self._close_locked()
                raise ChannelTimeout(f"{method}: no reply within {pending.timeout_s}s") from exc
            except OSError as exc:  # ChannelLost included
                self._close_locked()
                raise ChannelLost(f"{method}: {exc}") from exc
            try:
                reply_id, ok, value, handler_s = decode_answer(kind, payload, method)
            except Exception as exc:  # a worker of another version, or a corrupt frame: the link is not usable
                self._close_locked()
                raise ChannelLost(f"{method}: an answer that does not decode: {exc!r}") from exc
            if reply_id != pending.call_id:
                self._close_locked()
                raise ChannelLost(f"{method}: reply {reply_id} to call {pending.call_id}")
            self.totals.calls += 1
            self.totals.round_trip_seconds += time.perf_counter() - pending.start
            self.totals.handler_seconds += handler_s
            return ok, value
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None


class PendingCall:
    """A call on its way (`ChannelClient.send`); `result()` waits for its answer once, then returns it again (or
    raises what the worker raised, or ChannelLost / ChannelTimeout). Owner: the thread that sent it."""

    def __init__(self, client: ChannelClient, call_id: int, method: str, start: float,
                 timeout_s: float | None) -> None:
        self.client = client
        self.call_id = call_id
        self.method = method
        self.start = start
        self.timeout_s = timeout_s
        self._answer: tuple[bool, Any] | None = None
        self._failure: BaseException | None = None

    def result(self) -> Any:
        if self._answer is None and self._failure is None:
            try:
                self._answer = self.client._receive(self)
            except BaseException as exc:
                self._failure = exc
        if self._failure is not None:
            raise self._failure
        assert self._answer is not None
        ok, value = self._answer
        if not ok:
            raise value
        return value


class ChannelLink:
    """A caller's link to one worker across its replacements: `resolve()` asks Ray for the worker's current
    endpoint (on the first call, and after a connection broke); a broken or timed-out call drops the
    connection and raises. Totals add up over every connection. Thread-safe."""

    def __init__(self, resolve: Callable[[], Endpoint], local_node_id: str | None) -> None:
        self._resolve = resolve
        self._local_node_id = local_node_id
        self._client: ChannelClient | None = None
        self._lock = threading.Lock()
        self._done = ChannelTotals()  # of closed connections
        self.connects = 0

    def _current(self) -> ChannelClient:
        with self._lock:
            if self._client is None or not self._client.connected:
                if self._client is not None:
                    self._retire(self._client)
                self._client = ChannelClient(self._resolve(), self._local_node_id)
                self.connects += 1
            return self._client

    def _retire(self, client: ChannelClient) -> None:
        self._done = self._done + client.totals
        client.close()
        if self._client is client:
            self._client = None

    def call(self, method: str, *args: Any, timeout_s: float | None = None,
             on_sent: Callable[[], None] | None = None, **kwargs: Any) -> Any:
        return self._current().call(method, *args, timeout_s=timeout_s, on_sent=on_sent, **kwargs)

    def send(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> PendingCall:
        return self._current().send(method, *args, timeout_s=timeout_s, **kwargs)

    def totals(self) -> ChannelTotals:
        with self._lock:
            return self._done + (self._client.totals if self._client is not None else ChannelTotals())

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._retire(self._client)
