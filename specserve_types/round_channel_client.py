"""The round channel's caller side (specserve_types/round_channel.py holds the frames, the endpoint and the
server): `ChannelClient`, one blocking connection to one endpoint; `PendingCall`, a call sent and not yet answered;
`ChannelLink`, a client that reconnects through Ray after its connection broke."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from specserve_types.round_channel import (
    NONCE_BYTES,
    ChannelLost,
    ChannelTimeout,
    ChannelTotals,
    Endpoint,
    auth_digest,
    recv_exact,
    recv_frame,
)
from specserve_types.round_codec import decode_answer, encode_call

log = logging.getLogger("specserve.channel")


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
            nonce = recv_exact(sock, NONCE_BYTES)
            sock.sendall(auth_digest(ep.secret, nonce))
            recv_exact(sock, 1)
        except OSError as exc:
            raise ChannelLost(f"cannot connect to {ep!r}: {exc}") from exc
        # once per connection (the first call, a replacement worker): which way the round's frames travel
        if sock.family == socket.AF_UNIX:
            log.info("channel connected: unix (same node) to %r", ep)
        else:
            log.info("channel connected: tcp %s:%d -> %s:%d to %r", *sock.getsockname()[:2], *sock.getpeername()[:2],
                     ep)
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
                kind, payload = recv_frame(sock)
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
