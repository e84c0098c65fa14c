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
frame is decoded; the secret travels only inside Ray. Until it has, a connection is pending: at most
MAX_PENDING_PER_PEER at once per peer (its IP address; a Unix socket's: its uid), the rest closed as they come, and
each has HANDSHAKE_TIMEOUT_S to answer. Refused connections log one WARNING line per kind of refusal per 10 s
(`RefusalLog`, the ingress's rate limit; the next line says how many were suppressed). A frame is a length, a kind and a payload: the round's hot
methods (`verify`, `propose`) as typed MessagePack, everything else a pickle (specserve_types/round_codec.py).

A call's reply carries the handler's own seconds, so a client knows its transport's own time: round trip minus
handler (`ChannelTotals`). Failures: a broken connection raises `ChannelLost` (a ConnectionError), a reply
later than the timeout `ChannelTimeout` (a TimeoutError); either closes the connection (the caller connects
again, through Ray, on its next call). An exception raised by the handler is raised at the caller as it is.

This module: the frames' reading, the endpoint, the errors and totals, and the server; the caller's side
(`ChannelClient`, `PendingCall`, `ChannelLink`) is round_channel_client.py.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from specserve_types.round_codec import (
    FRAME_HEADER,
    CallFrame,
    encode_answer,
)

log = logging.getLogger("specserve.channel")

NONCE_BYTES = 32
MAX_FRAME = 1 << 34  # 16 GiB: a sanity bound on a length read off the wire

Handler = Callable[..., Any]  # blocking; runs on the channel's connection thread (or its FrameReader's)
FRAME_TIMEOUT_S = 10.0  # a watched connection's frame: its rest is due within this once its first bytes are in
MAX_PENDING_PER_PEER = 8  # connections of one peer not yet past the handshake (a caller has one per worker)
HANDSHAKE_TIMEOUT_S = 5.0  # a connection's answer to the nonce is due within this (a caller answers in microseconds)
REFUSAL_LOG_WINDOW_S = 10.0


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


def auth_digest(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


def peer_of(sock: socket.socket | None, address: Any) -> str:
    """Whom a connection counts against: a TCP peer's IP address, a Unix socket peer's uid (SO_PEERCRED)."""
    if isinstance(address, tuple) and address:
        return str(address[0])
    try:
        assert sock is not None
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return f"uid {uid}"
    except (AssertionError, AttributeError, OSError):
        return "unix"


class PendingPeers:
    """Connections that have not yet proved the secret, counted per peer: `admit` says whether one more may start
    its handshake (at most `cap` per peer at once), `release` ends its count (exactly once per admitted one)."""

    def __init__(self, cap: int = MAX_PENDING_PER_PEER) -> None:
        self.cap = cap
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, peer: str) -> bool:
        with self._lock:
            count = self._counts.get(peer, 0)
            if count >= self.cap:
                return False
            self._counts[peer] = count + 1
            return True

    def release(self, peer: str) -> None:
        with self._lock:
            count = self._counts.pop(peer, 0) - 1
            if count > 0:
                self._counts[peer] = count

    def pending(self, peer: str) -> int:
        with self._lock:
            return self._counts.get(peer, 0)


class RefusalLog:
    """Refused connections: one WARNING line per kind of refusal per `window_s`, the next saying how many were
    suppressed since (the ingress's RejectionLog, cluster/serving/rejections.py, locked for the channels' threads)."""

    def __init__(self, logger: logging.Logger, what: str, window_s: float = REFUSAL_LOG_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._what = what
        self._window_s = window_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()
        self.total = 0

    def refused(self, peer: str, reason: str) -> bool:
        """Record one refused connection; returns whether a line was written."""
        with self._lock:
            self.total += 1
            now = self._clock()
            last = self._last.get(reason)
            if last is not None and now - last < self._window_s:
                self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
                return False
            self._last[reason] = now
            suppressed = self._suppressed.pop(reason, 0)
        note = f" (+{suppressed} like it suppressed in the last {self._window_s:g}s)" if suppressed else ""
        self._logger.warning("%s: a connection from %s refused: %s%s", self._what, peer, reason, note)
        return True


NO_SECRET = "it did not prove the secret"
CLOSED = "it closed before proving the secret"


def no_answer(timeout_s: float) -> str:
    return f"no answer to the nonce within {timeout_s:g}s"


def too_many(cap: int) -> str:
    return f"{cap} of its connections already wait for their handshake"


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
        self.pending = PendingPeers()
        self.refusals = RefusalLog(log, f"{name} channel")
        self.handshake_timeout_s = HANDSHAKE_TIMEOUT_S

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
                conn, address = listener.accept()
            except OSError:
                return  # closed
            peer = peer_of(conn, address)
            if not self.pending.admit(peer):  # closed before it costs a thread
                conn.close()
                self.refusals.refused(peer, too_many(self.pending.cap))
                continue
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, peer), name=f"{self.name}-channel", daemon=True).start()

    def _handshake(self, conn: socket.socket, peer: str) -> bool:
        """Whether the connection proved the secret within the timeout (a refusal is logged, rate-limited)."""
        try:
            conn.settimeout(self.handshake_timeout_s)
            nonce = secrets.token_bytes(NONCE_BYTES)
            conn.sendall(nonce)
            answer = recv_exact(conn, 32)
        except TimeoutError:
            self.refusals.refused(peer, no_answer(self.handshake_timeout_s))
            return False
        except OSError:  # ChannelLost included
            self.refusals.refused(peer, CLOSED)
            return False
        finally:
            self.pending.release(peer)
        if not hmac.compare_digest(answer, auth_digest(self.secret, nonce)):
            self.refusals.refused(peer, NO_SECRET)
            return False
        return True

    def _serve(self, conn: socket.socket, peer: str) -> None:
        adopted = False  # handed to the reader, which closes it
        try:
            if not self._handshake(conn, peer):
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
        self._answer(conn, CallFrame(*recv_frame(conn)))

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


def recv_frame(sock: socket.socket) -> tuple[int, bytearray]:
    """One frame's kind and payload (round_codec.py); ChannelLost for a length no frame has."""
    length, kind = FRAME_HEADER.unpack(recv_exact(sock, FRAME_HEADER.size))
    if not 1 <= length <= MAX_FRAME:
        log.warning("channel: a %d-byte frame refused", length)
        raise ChannelLost(f"a {length}-byte frame")
    return kind, recv_exact(sock, length - 1)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
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
