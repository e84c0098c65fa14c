"""One request's stream from the Scheduler, as both front ends (gRPC, HTTP) consume it.

`SchedulerStreams.open(args, timeout_s)` starts the scheduler's stream and waits for its first item: a
refusal (invalid, capacity) arrives as that first item, before anything is sent to the client.
`ChunkStream.cancel()` is synchronous and idempotent, so a consumer's `finally` reaches the scheduler at
once; it cancels the stream and also calls the scheduler's `abort` directly (a second path: a cancelled
handle stream reaches the replica only when Serve closes the generator).

Owner: a ChunkStream belongs to the one coroutine that serves its call (no locking).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from cluster.serving.chunk_push import ChunkInbox, PushedChunks, PushStarted
from specserve_types.api import SpecServeError
from specserve_types.protocol import GenerateArgs, IndexedChunk, StreamError


class DeadlineExceeded(SpecServeError, TimeoutError):
    """The call's time limit passed before its last chunk (the request was aborted)."""


async def until(awaitable: Any, deadline: float | None) -> Any:
    """Await `awaitable`, or raise DeadlineExceeded once time.monotonic() passes `deadline`."""
    if deadline is None:
        return await awaitable
    try:  # asyncio.timeout, not wait_for: no task of its own per chunk
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            return await awaitable
    except TimeoutError:
        raise DeadlineExceeded("deadline exceeded") from None


class ChunkStream:
    """One request's chunks from the scheduler; StreamError items are raised as their exceptions."""

    def __init__(self, stream: Any = None, first: IndexedChunk | None = None,
                 abort: Callable[[], Any] | None = None, deadline: float | None = None) -> None:
        self._stream = stream
        self._first = first
        self._abort = abort  # tells the scheduler directly (a second path besides the stream's cancel)
        self._deadline = deadline  # time.monotonic() after which the request is aborted
        self._done = stream is None

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> IndexedChunk:
        if self._first is not None:
            item, self._first = self._first, None
        elif self._stream is None:
            raise StopAsyncIteration
        else:
            try:
                item = await until(self._stream.__anext__(), self._deadline)
            except StopAsyncIteration:
                self._done = True
                raise
            except DeadlineExceeded:
                self.cancel()
                raise
        if isinstance(item, StreamError):
            self._done = True
            self.cancel()
            raise item.to_exception()
        return item

    def cancel(self) -> None:
        if self._stream is not None:
            self._stream.cancel()  # a no-op once the stream is done
        if not self._done and self._abort is not None:
            self._done = True
            self._abort()


class SchedulerStreams:
    """Opens request streams on the Scheduler deployment (a Serve handle) and forwards control calls. With an
    `inbox` (started on this event loop) the scheduler pushes each request's chunks to it over a socket, and the Serve
    stream carries only the admission, an error and the end (cluster/serving/chunk_push.py)."""

    def __init__(self, scheduler: Any, inbox: ChunkInbox | None = None) -> None:
        self._scheduler = scheduler
        self._inbox = inbox

    async def open(self, args: GenerateArgs, timeout_s: float | None = None) -> tuple[StreamError | None, ChunkStream]:
        """Start the scheduler stream; a refusal is returned before the first chunk is."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        inbox = self._inbox
        target, queue = inbox.expect() if inbox is not None else (None, None)
        stream = self._scheduler.options(stream=True).generate.remote(args, target)

        def forget() -> None:
            if inbox is not None and target is not None:
                inbox.forget(target.key)

        try:
            first = await until(stream.__anext__(), deadline)
        except BaseException:  # the client left, the deadline passed or the call failed before the first chunk
            stream.cancel()
            forget()
            self._scheduler.abort.remote(args.request_id)
            raise
        abort = lambda: self._scheduler.abort.remote(args.request_id)  # noqa: E731
        if isinstance(first, PushStarted) and queue is not None:
            return None, ChunkStream(PushedChunks(stream, queue, forget), None, abort=abort, deadline=deadline)
        forget()  # refused, or the scheduler could not reach the inbox: the chunks come through the Serve stream
        if isinstance(first, StreamError):
            stream.cancel()
            return first, ChunkStream()
        return None, ChunkStream(stream, first, abort=abort, deadline=deadline)

    async def health(self) -> tuple[bool, str]:
        return await self._scheduler.health.remote()

    async def stats(self) -> dict[str, Any]:
        return await self._scheduler.stats.remote()

    async def metrics_text(self) -> bytes:
        return await self._scheduler.metrics_text.remote()
