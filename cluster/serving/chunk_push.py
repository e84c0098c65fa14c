"""A request's chunks from the Scheduler to the Ingress over a socket of their own, beside Serve's streaming call.

    ingress replica (its event loop)                       scheduler replica (its event loop)
    --------------------------------                       ----------------------------------
    key = inbox.expect() -> a queue
    scheduler.generate(args, PushTarget(endpoint, key))  --Serve-->  admission (refusals: the stream's first item)
                                                          <--Serve--  PushStarted: the chunks come over the socket
    queue <- (key, IndexedChunk) frames                  <-socket--  ChunkPusher: one frame per chunk
                                                          <--Serve--  PushEnded(count) after the last one
    PushedChunks ends once it has `count` chunks

Why: every item of a Serve streaming call costs both processes Ray's machinery (an object per item, the core
worker's report and its answer, the router's event loop). Measured on the Xeon-AMX (2 vCPUs, the Qwen pair through
`specserve up`, plain decoding with the q4 target, one chunk a ~60 ms round, 2026-12-04): beyond their idle load
the ingress used ~1.3 ms of CPU per chunk and the scheduler ~1.8, and on a small node that CPU is taken from the
verifier's forward, which runs meanwhile. A frame on a connected socket costs tens of microseconds.

Serve keeps everything else: it routes the request to a scheduler replica, carries a refusal (the first item),
an error (a StreamError, or the exception of a dead replica) and the end with its count, and cancelling the call
still reaches the scheduler. The connection (one per scheduler replica and ingress inbox, made on the first
request) proves it holds the inbox's secret, as the round channels do (specserve_types/round_channel.py, with their
caps: at most MAX_PENDING_PER_PEER connections per peer before their handshake, HANDSHAKE_TIMEOUT_S each, refusals
logged rate-limited); the secret travels only inside Ray. If the scheduler cannot reach the inbox, that request's chunks go through the
Serve call as before; a connection lost mid-request ends the request with an internal error (the scheduler
aborts it), never with a silent gap: the ingress waits for `count` chunks, or END_GRACE_S after the end at most.

Owners: the inbox's queues belong to the ingress's event loop; a ChunkPusher's links to the scheduler's.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import pickle
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specserve_types.api import SpecServeError
from specserve_types.protocol import StreamError
from specserve_types.round_channel import (
    CLOSED,
    HANDSHAKE_TIMEOUT_S,
    NO_SECRET,
    NONCE_BYTES,
    Endpoint,
    PendingPeers,
    RefusalLog,
    auth_digest,
    no_answer,
    peer_of,
    too_many,
)

log = logging.getLogger("ray.serve")

LENGTH = struct.Struct(">I")
MAX_FRAME = 64 << 20  # a chunk frame's bound (a final chunk carries its statistics)
MAX_BUFFERED = 64 << 20  # a link whose unsent bytes pass this is treated as lost (the ingress stopped reading)
CONNECT_TIMEOUT_S = 10.0
END_GRACE_S = 10.0  # after the end, the longest the ingress waits for chunks still on their way


@dataclass(frozen=True)
class PushTarget:
    """Where the scheduler pushes one request's chunks: an inbox's endpoint and the request's key there."""

    endpoint: Endpoint
    key: int


@dataclass(frozen=True)
class PushStarted:
    """The Serve stream's first item when the request was admitted and its chunks come over the inbox."""


@dataclass(frozen=True)
class PushEnded:
    """The Serve stream's last item: `count` chunks were pushed."""

    count: int


class PushLost(ConnectionError):
    """The connection to the ingress's inbox broke (or stopped draining) mid-request."""


# -- the ingress's side --------------------------------------------------------------------------------------------


class ChunkInbox:
    """Listens for schedulers' pushes (an abstract Unix socket and TCP on `host`) and hands each frame to the queue of
    its key. Frames of a key nobody expects (a request already gone) are dropped."""

    def __init__(self, node_id: str | None, host: str) -> None:
        self.node_id = node_id
        self.host = host
        self.endpoint: Endpoint | None = None
        self._secret = secrets.token_bytes(32)
        self._instance = secrets.token_hex(8)
        self._keys = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[Any]] = {}
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: dict[asyncio.StreamWriter, asyncio.Task[Any]] = {}
        self.pending = PendingPeers()
        self.refusals = RefusalLog(log, "chunk inbox")
        self.handshake_timeout_s = HANDSHAKE_TIMEOUT_S

    async def start(self) -> Endpoint:
        tcp = await asyncio.start_server(self._serve, self.host, 0)
        self._servers.append(tcp)
        port = tcp.sockets[0].getsockname()[1]
        unix_name: str | None = None
        if os.uname().sysname == "Linux":  # abstract: no file to clean up, scoped to the network namespace
            unix_name = f"specserve-chunks-{os.getpid()}-{self._instance}"
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # bound here: uvloop (Serve's event loop)
            unix.bind("\0" + unix_name)  # takes no abstract path of its own
            self._servers.append(await asyncio.start_unix_server(self._serve, sock=unix))
        self.endpoint = Endpoint(self.node_id or "", unix_name, self.host, port, self._secret, self._instance)
        log.info("chunk inbox listening: %r", self.endpoint)
        return self.endpoint

    def expect(self) -> tuple[PushTarget, asyncio.Queue[Any]]:
        """A new key and its queue (the caller forgets it when its request ends)."""
        assert self.endpoint is not None, "start() first"
        key = next(self._keys)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[key] = queue
        return PushTarget(self.endpoint, key), queue

    def forget(self, key: int) -> None:
        self._queues.pop(key, None)

    @property
    def expected(self) -> int:
        return len(self._queues)

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        self._servers = []
        for writer in list(self._connections):
            writer.close()
        if self._connections:  # their readers end on the closed transports
            await asyncio.wait(list(self._connections.values()), timeout=CONNECT_TIMEOUT_S)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[writer] = task
        try:
            if not await self._handshake(reader, writer):
                return
            writer.write(b"\1")
            while True:
                (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
                if not 1 <= length <= MAX_FRAME:
                    log.warning("chunk inbox: a %d-byte frame refused; connection closed", length)
                    return
                key, item = pickle.loads(await reader.readexactly(length))  # an authenticated scheduler's frame
                queue = self._queues.get(key)
                if queue is not None:
                    queue.put_nowait(item)
        except (asyncio.IncompleteReadError, OSError, TimeoutError):
            pass  # the scheduler went away (its requests end through their Serve streams)
        finally:
            self._connections.pop(writer, None)
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Whether the connection proved the secret in time; at most `pending.cap` per peer try at once (the rest
        are closed as they come); each refusal logged, rate-limited."""
        peer = peer_of(writer.get_extra_info("socket"), writer.get_extra_info("peername"))
        if not self.pending.admit(peer):
            self.refusals.refused(peer, too_many(self.pending.cap))
            return False
        try:
            nonce = secrets.token_bytes(NONCE_BYTES)
            writer.write(nonce)
            digest = await asyncio.wait_for(reader.readexactly(32), self.handshake_timeout_s)
        except TimeoutError:
            self.refusals.refused(peer, no_answer(self.handshake_timeout_s))
            return False
        except (asyncio.IncompleteReadError, OSError):
            self.refusals.refused(peer, CLOSED)
            return False
        finally:
            self.pending.release(peer)
        if not hmac.compare_digest(digest, auth_digest(self._secret, nonce)):
            self.refusals.refused(peer, NO_SECRET)
            return False
        return True


class PushedChunks:
    """One pushed request's chunks: from its inbox queue, until the Serve stream's PushEnded count is reached. A
    StreamError or an exception on the Serve stream (a dead replica) comes out in order, as the plain stream's would.
    `cancel()` cancels the Serve stream (the scheduler aborts the request) and forgets the key; idempotent."""

    def __init__(self, stream: Any, queue: asyncio.Queue[Any], forget: Callable[[], None]) -> None:
        self._stream = stream
        self._queue = queue
        self._forget = forget
        self._expected: int | None = None
        self._received = 0
        self._watch = asyncio.ensure_future(self._watch_stream())

    async def _watch_stream(self) -> None:
        try:
            async for item in self._stream:  # PushEnded, or a StreamError
                self._queue.put_nowait(item)
                if isinstance(item, (PushEnded, StreamError)):
                    return
            self._queue.put_nowait(_Failed(SpecServeError("the scheduler's stream ended before its last chunk")))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # e.g. the replica died: raised to the consumer as the plain stream would
            self._queue.put_nowait(_Failed(exc))

    def __aiter__(self) -> PushedChunks:
        return self

    async def __anext__(self) -> Any:
        while True:
            if self._expected is not None and self._received >= self._expected:
                self.cancel()
                raise StopAsyncIteration
            if self._expected is None:
                item = await self._queue.get()
            else:
                try:
                    item = await asyncio.wait_for(self._queue.get(), END_GRACE_S)
                except TimeoutError:
                    self.cancel()
                    raise SpecServeError(f"{self._expected - self._received} of the request's chunks never arrived "
                                         "from the scheduler") from None
            if isinstance(item, PushEnded):
                self._expected = item.count
                continue
            if isinstance(item, _Failed):
                self.cancel()
                raise item.error
            if isinstance(item, StreamError):  # ChunkStream raises it (and cancels)
                return item
            self._received += 1
            return item

    def cancel(self) -> None:
        if not self._watch.done():
            self._watch.cancel()
        self._stream.cancel()
        self._forget()


@dataclass(frozen=True)
class _Failed:
    error: BaseException


# -- the scheduler's side ------------------------------------------------------------------------------------------


class PushLink:
    """One connection to an inbox; `push` writes a frame without waiting (the event loop's transport sends it)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    def push(self, key: int, item: Any) -> None:
        transport = self._writer.transport
        if self._writer.is_closing() or transport.get_write_buffer_size() > MAX_BUFFERED:
            self._writer.close()
            raise PushLost("the connection to the ingress's chunk inbox is lost")
        payload = pickle.dumps((key, item), protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(LENGTH.pack(len(payload)) + payload)

    def close(self) -> None:
        self._writer.close()


class ChunkPusher:
    """The scheduler's links to ingress inboxes, one per inbox (made on its first request, again after a loss)."""

    def __init__(self, local_node_id: str | None) -> None:
        self.local_node_id = local_node_id
        self._links: dict[str, PushLink] = {}
        self._lock = asyncio.Lock()

    async def link(self, endpoint: Endpoint) -> PushLink:
        """The open link to `endpoint` (connecting if needed); OSError / TimeoutError if it cannot be reached."""
        link = self._links.get(endpoint.instance)
        if link is not None and not link.closed:
            return link
        async with self._lock:
            link = self._links.get(endpoint.instance)
            if link is None or link.closed:
                self._links = {instance: kept for instance, kept in self._links.items() if not kept.closed}
                link = PushLink(await asyncio.wait_for(self._connect(endpoint), CONNECT_TIMEOUT_S))
                self._links[endpoint.instance] = link
                log.info("chunks pushed to the ingress inbox %r", endpoint)
            return link

    async def _connect(self, endpoint: Endpoint) -> asyncio.StreamWriter:
        if endpoint.unix_name is not None and self.local_node_id == endpoint.node_id:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:  # a local listener answers at once; connected here since uvloop takes no abstract path
                sock.settimeout(CONNECT_TIMEOUT_S)
                sock.connect("\0" + endpoint.unix_name)
                sock.setblocking(False)
            except OSError:
                sock.close()
                raise
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        else:
            reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        try:
            nonce = await reader.readexactly(NONCE_BYTES)
            writer.write(auth_digest(endpoint.secret, nonce))
            await reader.readexactly(1)
        except BaseException:
            writer.close()
            raise
        return writer

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links = {}
