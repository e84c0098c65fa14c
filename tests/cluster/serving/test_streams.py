"""The scheduler stream wrapper and call time limits, without Ray: a deadline aborts the request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from cluster.serving.grpc_service import call_timeout
from cluster.serving.streams import ChunkStream, DeadlineExceeded
from specserve_types.api import InvalidRequestError, TokenChunk
from specserve_types.protocol import TIMEOUT_METADATA, IndexedChunk


class SlowStream:
    """Scheduler stream stand-in: one chunk every `period_s`, `cancel()` recorded."""

    def __init__(self, chunks: list[IndexedChunk], period_s: float) -> None:
        self._chunks = iter(chunks)
        self.period_s = period_s
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[IndexedChunk]:
        return self

    async def __anext__(self) -> IndexedChunk:
        await asyncio.sleep(self.period_s)
        try:
            return next(self._chunks)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        self.cancelled = True


def chunk(i: int) -> IndexedChunk:
    return IndexedChunk(0, TokenChunk("r1", [i]), "greedy")


def test_call_timeout_takes_the_metadata_capped_by_the_server_limit() -> None:
    assert call_timeout([], None) is None
    assert call_timeout([("application", "specserve")], 30.0) == 30.0
    assert call_timeout([(TIMEOUT_METADATA, "2.5")], None) == 2.5
    assert call_timeout([(TIMEOUT_METADATA, "60")], 30.0) == 30.0
    for bad in ("abc", "0", "-1", "inf", "nan"):
        with pytest.raises(InvalidRequestError) as info:
            call_timeout([(TIMEOUT_METADATA, bad)], None)
        assert info.value.field == TIMEOUT_METADATA


def test_a_passed_deadline_cancels_the_stream_and_aborts_once() -> None:
    aborts: list[str] = []
    stream = SlowStream([chunk(i) for i in range(100)], period_s=0.02)

    async def consume() -> int:
        chunks = ChunkStream(stream, chunk(0), abort=lambda: aborts.append("r1"), deadline=time.monotonic() + 0.15)
        received = 0
        with pytest.raises(DeadlineExceeded):
            async for _ in chunks:
                received += 1
        chunks.cancel()  # the consumer's finally: nothing more happens
        return received

    received = asyncio.run(consume())
    assert 2 <= received < 100 and stream.cancelled and aborts == ["r1"]


def test_a_stream_that_ends_in_time_aborts_nothing() -> None:
    aborts: list[str] = []
    stream = SlowStream([chunk(i) for i in range(3)], period_s=0.01)

    async def consume() -> int:
        chunks = ChunkStream(stream, chunk(0), abort=lambda: aborts.append("r1"), deadline=time.monotonic() + 30)
        received = len([c async for c in chunks])
        chunks.cancel()
        return received

    assert asyncio.run(consume()) == 4 and aborts == []
