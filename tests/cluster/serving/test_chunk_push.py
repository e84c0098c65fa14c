"""The chunks' own socket from the scheduler to the ingress (cluster/serving/chunk_push.py), without Ray: the inbox and
the pusher on one event loop, the pushed stream's end and failures, and the Scheduler and SchedulerStreams with a
scripted engine through a stand-in for Serve's streaming handle."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
from typing import Any

import pytest

from cluster.serving import chunk_push
from cluster.serving.chunk_push import (
    ChunkInbox,
    ChunkPusher,
    PushedChunks,
    PushEnded,
    PushLost,
    PushStarted,
)
from cluster.serving.streams import SchedulerStreams
from specserve_types.api import SpecServeError, TokenChunk
from specserve_types.protocol import IndexedChunk, StreamError
from specserve_types.round_channel import MAX_PENDING_PER_PEER, NONCE_BYTES
from tests.cluster.serving.test_scheduler_loop import ScriptedEngine, args, make_scheduler, wait_until

NODE = "node-a"


def chunk(rid: str, token: int, final: bool = False) -> IndexedChunk:
    return IndexedChunk(0, TokenChunk(rid, [token], str(token), finish_reason="length" if final else None), "greedy")


async def started_inbox() -> ChunkInbox:
    inbox = ChunkInbox(NODE, "127.0.0.1")
    await inbox.start()
    return inbox


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])  # Serve runs replicas on uvloop where installed
@pytest.mark.parametrize("local_node", [NODE, "another-node"], ids=["unix", "tcp"])
def test_frames_reach_their_keys_queue_in_order(local_node: str, event_loop: str) -> None:
    async def scenario() -> tuple[list[Any], int]:
        inbox = await started_inbox()
        pusher = ChunkPusher(local_node)
        target, queue = inbox.expect()
        other, other_queue = inbox.expect()
        link = await pusher.link(target.endpoint)
        assert await pusher.link(target.endpoint) is link  # one connection per inbox
        for token in range(5):
            link.push(target.key, chunk("r", token))
        link.push(999, chunk("gone", 0))  # a key nobody expects: dropped
        link.push(other.key, chunk("o", 7))
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(5)]
        assert (await asyncio.wait_for(other_queue.get(), 5)).chunk.token_ids == [7]
        inbox.forget(target.key)
        inbox.forget(other.key)
        pusher.close()
        await inbox.close()
        return got, inbox.expected

    run = pytest.importorskip("uvloop").run if event_loop == "uvloop" else asyncio.run  # ray[serve] installs uvloop
    got, expected = run(scenario())
    assert [item.chunk.token_ids[0] for item in got] == [0, 1, 2, 3, 4]
    assert all(isinstance(item, IndexedChunk) for item in got) and expected == 0


def test_a_connection_without_the_secret_is_refused() -> None:
    async def scenario() -> None:
        inbox = await started_inbox()
        assert inbox.endpoint is not None
        forged = dataclasses.replace(inbox.endpoint, secret=b"x" * 32)
        with pytest.raises(EOFError):  # the inbox closes without its acknowledgement
            await ChunkPusher(NODE).link(forged)
        await inbox.close()

    asyncio.run(scenario())


def test_a_lost_inbox_makes_the_push_fail() -> None:
    async def scenario() -> None:
        inbox = await started_inbox()
        target, _ = inbox.expect()
        link = await ChunkPusher(NODE).link(target.endpoint)
        await inbox.close()  # the ingress went away
        with pytest.raises(PushLost):
            for _ in range(200):
                link.push(target.key, chunk("r", 1))
                await asyncio.sleep(0.01)

    asyncio.run(scenario())


class ServeStream:
    """A stand-in for Serve's streaming call: an async iterator of `items` (an exception is raised), cancellable."""

    def __init__(self, items: list[Any], delay_s: float = 0.0) -> None:
        self._items = list(items)
        self._delay_s = delay_s
        self.cancelled = False

    def __aiter__(self) -> ServeStream:
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(self._delay_s)
        if not self._items:
            raise StopAsyncIteration
        item = self._items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


def test_pushed_chunks_wait_for_the_count_even_when_the_end_comes_first() -> None:
    async def scenario() -> tuple[list[Any], bool, list[str]]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        forgotten: list[str] = []
        stream = ServeStream([PushEnded(3)])
        pushed = PushedChunks(stream, queue, lambda: forgotten.append("k"))
        await asyncio.sleep(0.01)  # the end is in the queue before any chunk

        async def arrive() -> None:
            for token in range(3):
                await asyncio.sleep(0.01)
                queue.put_nowait(chunk("r", token))

        feeder = asyncio.create_task(arrive())
        items = [item async for item in pushed]
        await feeder
        return items, stream.cancelled, forgotten

    items, cancelled, forgotten = asyncio.run(scenario())
    assert [item.chunk.token_ids[0] for item in items] == [0, 1, 2]
    assert forgotten and cancelled  # done: the key is forgotten (cancelling a finished Serve call is a no-op)


def test_a_dead_scheduler_is_raised_to_the_consumer() -> None:
    class ReplicaDied(RuntimeError):
        pass

    async def scenario() -> list[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        queue.put_nowait(chunk("r", 0))
        pushed = PushedChunks(ServeStream([ReplicaDied("gone")], delay_s=0.02), queue, lambda: None)
        got = [await pushed.__anext__()]
        with pytest.raises(ReplicaDied):
            await pushed.__anext__()
        return got

    assert len(asyncio.run(scenario())) == 1


def test_a_stream_error_comes_out_in_order_and_missing_chunks_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunk_push, "END_GRACE_S", 0.1)

    async def scenario() -> tuple[Any, type[BaseException]]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        error = await PushedChunks(ServeStream([StreamError("internal", "boom")]), queue, lambda: None).__anext__()
        queue = asyncio.Queue()
        short = PushedChunks(ServeStream([PushEnded(2)]), queue, lambda: None)
        queue.put_nowait(chunk("r", 0))
        await short.__anext__()
        with pytest.raises(SpecServeError, match="1 of the request's chunks never arrived") as lost:
            await short.__anext__()
        return error, lost.type

    error, _ = asyncio.run(scenario())
    assert error == StreamError("internal", "boom")


class Handle:
    """Serve's handle to a Scheduler, in process: `options(stream=True).generate.remote(...)` runs the generator."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.aborted: list[str] = []
        self.generate = self
        self.abort = type("Abort", (), {"remote": lambda _, rid: self.aborted.append(rid)})()

    def options(self, stream: bool) -> Handle:
        return self

    def remote(self, *call: Any) -> Any:
        generator = self.scheduler.generate(*call)

        class Call:
            def __aiter__(self) -> Any:
                return self

            async def __anext__(self) -> Any:
                return await generator.__anext__()

            def cancel(self) -> None:
                asyncio.ensure_future(generator.aclose())

        return Call()


def test_the_scheduler_pushes_to_the_ingress_and_serve_carries_the_rest() -> None:
    engine = ScriptedEngine()
    scheduler = make_scheduler(engine)

    async def scenario() -> tuple[list[Any], list[Any], Any, int]:
        inbox = await started_inbox()
        target, queue = inbox.expect()
        serve_items = [item async for item in scheduler.generate(args("p1", "abc", max_tokens=3), target)]
        pushed = [await asyncio.wait_for(queue.get(), 5) for _ in range(3)]
        inbox.forget(target.key)
        streams = SchedulerStreams(Handle(scheduler), inbox)
        error, chunks = await streams.open(args("p2", "ab", max_tokens=4, n=2))
        through = [item async for item in chunks]
        await inbox.close()
        return serve_items, pushed, (error, through), inbox.expected

    serve_items, pushed, (error, through), expected = asyncio.run(scenario())
    assert serve_items == [PushStarted(), PushEnded(3)]
    assert [item.chunk.token_ids for item in pushed] == [[3], [4], [5]]
    assert pushed[-1].chunk.finish_reason == "length" and pushed[-1].chunk.stats["prompt_tokens"] == 3
    assert error is None and expected == 0
    assert sorted((item.index, item.chunk.token_ids[0]) for item in through) == \
        [(i, t) for i in (0, 1) for t in (2, 3, 4, 5)]
    assert scheduler._live == 0 and not engine.held_blocks
    assert scheduler._chunks == {"pushed": 11, "through_serve": 0, "push_fallbacks": 0, "push_lost": 0}


def test_an_unreachable_inbox_falls_back_to_the_serve_stream() -> None:
    engine = ScriptedEngine()
    scheduler = make_scheduler(engine)

    async def scenario() -> list[Any]:
        inbox = await started_inbox()
        target, _ = inbox.expect()
        await inbox.close()
        return [item async for item in scheduler.generate(args("f1", "abc", max_tokens=2), target)]

    items = asyncio.run(scenario())
    assert [item.chunk.token_ids for item in items] == [[3], [4]]
    assert scheduler._live == 0 and not engine.held_blocks
    assert scheduler._chunks == {"pushed": 0, "through_serve": 2, "push_fallbacks": 1, "push_lost": 0}


def test_a_link_lost_mid_request_ends_it_with_an_error_and_aborts_it() -> None:
    engine = ScriptedEngine()
    scheduler = make_scheduler(engine)

    async def scenario() -> list[Any]:
        inbox = await started_inbox()
        target, queue = inbox.expect()
        stream = scheduler.generate(args("l1", "abc", max_tokens=60), target)
        items = [await stream.__anext__()]

        async def rest() -> list[Any]:  # Serve drives the generator whatever the caller reads
            return [item async for item in stream]

        driven = asyncio.create_task(rest())
        await asyncio.wait_for(queue.get(), 5)  # the first chunk arrived
        await inbox.close()
        return items + await driven

    items = asyncio.run(scenario())
    assert items[0] == PushStarted() and items[-1].code == "internal"
    assert wait_until(lambda: engine.aborted == ["l1"] and not engine.held_blocks)
    assert scheduler._live == 0 and scheduler._chunks["push_lost"] == 1


def test_without_an_inbox_every_chunk_comes_through_the_serve_stream() -> None:
    engine = ScriptedEngine()
    scheduler = make_scheduler(engine)

    async def scenario() -> list[Any]:
        error, chunks = await SchedulerStreams(Handle(scheduler)).open(args("s1", "abc", max_tokens=3))
        assert error is None
        return [item async for item in chunks]

    items = asyncio.run(scenario())
    assert [item.chunk.token_ids for item in items] == [[3], [4], [5]]
    assert scheduler._chunks == {"pushed": 0, "through_serve": 3, "push_fallbacks": 0, "push_lost": 0}
    assert scheduler._live == 0 and not engine.held_blocks


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_unauthenticated_connections_are_capped_per_peer_and_time_out(unix: bool, event_loop: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Twenty raw connections that never answer: MAX_PENDING_PER_PEER get the nonce, the rest are closed at once, the
    idle ones after the handshake timeout; a scheduler then links; one WARNING line per kind of refusal."""

    async def scenario() -> list[int]:
        inbox = await started_inbox()
        inbox.handshake_timeout_s = 1.0
        assert inbox.endpoint is not None
        endpoint = inbox.endpoint
        peer = f"uid {os.getuid()}" if unix else "127.0.0.1"

        async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            if unix:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect("\0" + str(endpoint.unix_name))
                sock.setblocking(False)
                return await asyncio.open_unix_connection(sock=sock)
            return await asyncio.open_connection(endpoint.host, endpoint.port)

        started = asyncio.get_running_loop().time()
        connections = [await connect() for _ in range(20)]
        got = [len(await asyncio.wait_for(reader.read(), 5)) for reader, _ in connections]  # to EOF
        assert asyncio.get_running_loop().time() - started >= 1.0  # the pending ones waited out the timeout
        assert inbox.pending.pending(peer) == 0
        for _, writer in connections:
            writer.close()
        link = await ChunkPusher(NODE if unix else "another-node").link(endpoint)  # a scheduler links again
        link.close()
        await inbox.close()
        return got

    run = pytest.importorskip("uvloop").run if event_loop == "uvloop" else asyncio.run
    with caplog.at_level(logging.WARNING, "ray.serve"):
        got = run(scenario())
    assert sorted(got) == [0] * (20 - MAX_PENDING_PER_PEER) + [NONCE_BYTES] * MAX_PENDING_PER_PEER
    refusals = [r.getMessage() for r in caplog.records if "chunk inbox" in r.getMessage()]
    assert len(refusals) == 2, refusals
    assert any("already wait for their handshake" in line for line in refusals)
    assert any("no answer to the nonce within 1s" in line for line in refusals)
