"""The gRPC surface on its own grpc.aio server over a fake scheduler (no Ray): every outcome a status code,
every departure an abort, refusals one log line."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from ray.exceptions import ActorDiedError

from cluster.client import map_rpc_error
from cluster.serving.grpc_server import GrpcServer
from cluster.serving.grpc_service import SERVICE_NAME, SpecServeService
from cluster.serving.rejections import RejectionLog
from cluster.serving.streams import ChunkStream, until
from specserve_types.api import Constraint, InvalidRequestError, TokenChunk
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.proto import specserve_pb2_grpc as pb_grpc
from specserve_types.protocol import GenerateArgs, IndexedChunk, ServerDefaults, StreamError

GENERATE = f"/{SERVICE_NAME}/Generate"


class Ticker:
    """A scheduler stream stand-in: one chunk every `period_s`, up to `count`."""

    def __init__(self, request_id: str, count: int, period_s: float) -> None:
        self._request_id = request_id
        self._left = count
        self._period_s = period_s

    def __aiter__(self) -> AsyncIterator[IndexedChunk]:
        return self

    async def __anext__(self) -> IndexedChunk:
        if self._left == 0:
            raise StopAsyncIteration
        await asyncio.sleep(self._period_s)
        self._left -= 1
        return IndexedChunk(0, TokenChunk(self._request_id, [7], "x", finish_reason="length" if not self._left else None),
                            "greedy")

    def cancel(self) -> None:
        pass


class FakeStreams:
    """SchedulerStreams' interface; `aborted` lists the request ids the service aborted."""

    def __init__(self, count: int = 200, period_s: float = 0.002, refuse: StreamError | None = None,
                 fail: BaseException | None = None) -> None:
        self.count, self.period_s, self.refuse, self.fail = count, period_s, refuse, fail
        self.opened: list[GenerateArgs] = []
        self.aborted: list[str] = []

    async def open(self, args: GenerateArgs, timeout_s: float | None = None) -> tuple[StreamError | None, ChunkStream]:
        self.opened.append(args)
        if self.fail is not None:
            raise self.fail
        if self.refuse is not None:
            return self.refuse, ChunkStream()
        count = 5 if args.request_id == "short" else self.count
        return None, ChunkStream(Ticker(args.request_id, count, self.period_s),
                                 abort=lambda: self.aborted.append(args.request_id))

    async def health(self) -> tuple[bool, str]:
        return True, "ok"

    async def stats(self) -> dict[str, Any]:
        return {"scheduler": {"live": 0}}


class CountingLogger(logging.Logger):
    def __init__(self) -> None:
        super().__init__("test-rejections")
        self.lines: list[str] = []

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.lines.append(str(msg) % args)


def serve_fake(streams: FakeStreams, test: Callable[[grpc.aio.Channel, CountingLogger], Awaitable[None]]) -> None:
    async def main() -> None:
        log = CountingLogger()
        service = SpecServeService(streams, ServerDefaults("m", "ngram"),
                                   lambda: [{"id": "m", "role": "target", "draft": "ngram"}],
                                   RejectionLog(log), server_timeout_s=None, retry_after_s=3)
        server = GrpcServer(service, "127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                await until(test(channel, log), asyncio.get_running_loop().time() + 60)
        finally:
            await server.stop(0.5)

    asyncio.run(main())


async def status_of(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    return info.value


def test_bytes_that_do_not_parse_are_invalid_argument() -> None:
    text = pb.GenerateRequest(text="abc").SerializeToString()
    invalid_utf8 = text.replace(b"abc", b"a\xff\xfe")
    assert invalid_utf8 != text

    async def test(channel: grpc.aio.Channel, log: CountingLogger) -> None:
        raw = channel.unary_stream(GENERATE)  # no serializer: the bytes go as they are
        for data in (b"\xff" * 9, invalid_utf8, b"\x0a\x80"):
            error = await status_of(raw(data))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (data, error)
            assert error.details().startswith("request: not a valid specserve.v1.GenerateRequest")
        unary = channel.unary_unary(f"/{SERVICE_NAME}/ListModels")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary(b"\xff\xff")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(log.lines) == 1  # rate-limited: one line per kind of refusal (code, field) and window

    streams = FakeStreams()
    serve_fake(streams, test)
    assert streams.opened == []


def test_bad_fields_answer_invalid_argument_with_one_log_line() -> None:
    async def test(channel: grpc.aio.Channel, log: CountingLogger) -> None:
        stub = pb_grpc.SpecServeStub(channel)
        error = await status_of(stub.Generate(pb.GenerateRequest(text="x", top_p=2.0, request_id="r-1")))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("top_p: ")
        error = await status_of(stub.Generate(pb.GenerateRequest(text="x", request_id="bad\nid")))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("request_id: ")
        assert len(log.lines) == 2 and "r-1" in log.lines[0] and "top_p" in log.lines[0]
        assert all("\n" not in line for line in log.lines)

    serve_fake(FakeStreams(), test)


def test_constraint_and_logit_bias_reach_the_scheduler_and_their_refusals_name_the_field() -> None:
    """The request's constraint and logit_bias arrive in GenerateArgs; a bad one (here, or the engine's compile
    at submit, reported as a StreamError) answers INVALID_ARGUMENT "constraint.KIND: reason", which the client maps
    back to InvalidRequestError with that field."""
    async def test(channel: grpc.aio.Channel, log: CountingLogger) -> None:
        stub = pb_grpc.SpecServeStub(channel)
        request = pb.GenerateRequest(text="x", constraint=pb.Constraint(choice=pb.Choices(choices=["yes", "no"])))
        request.logit_bias.update({7: -100.0})
        chunks = [c async for c in stub.Generate(request)]
        assert chunks[-1].finish_reason == "length"
        error = await status_of(stub.Generate(pb.GenerateRequest(text="x", constraint=pb.Constraint(regex=""))))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == "constraint.regex: must be non-empty"

    streams = FakeStreams(count=3)
    serve_fake(streams, test)
    (args,) = streams.opened
    assert args.constraint == Constraint("choice", '["yes", "no"]', "constraint.choice")
    assert args.sampling.logit_bias == ((7, -100.0),)

    async def refused(channel: grpc.aio.Channel, log: CountingLogger) -> None:
        error = await status_of(pb_grpc.SpecServeStub(channel).Generate(
            pb.GenerateRequest(text="x", constraint=pb.Constraint(grammar="start: ("))))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith("constraint.grammar: does not compile")
        mapped = map_rpc_error(error)
        assert isinstance(mapped, InvalidRequestError) and mapped.field == "constraint.grammar"

    serve_fake(FakeStreams(refuse=StreamError("invalid", "does not compile: syntax error", "constraint.grammar")),
               refused)


def test_application_metadata_is_optional_but_must_name_this_application() -> None:
    async def test(channel: grpc.aio.Channel, log: CountingLogger) -> None:
        stub = pb_grpc.SpecServeStub(channel)
        for metadata in ((), (("application", "specserve"),)):
            chunks = [c async for c in stub.Generate(pb.GenerateRequest(text="x"), metadata=metadata)]
            assert chunks[-1].finish_reason == "length"
        error = await status_of(stub.Generate(pb.GenerateRequest(text="x"), metadata=(("application", "other"),)))
        assert error.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListModels(pb.ListModelsRequest(), metadata=(("application", "other"),))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND

    serve_fake(FakeStreams(count=3), test)


def test_capacity_refusal_carries_a_retry_hint() -> None:
    async def test(channel: grpc.aio.Channel, log: CountingLogger) -> None:
        error = await status_of(pb_grpc.SpecServeStub(channel).Generate(pb.GenerateRequest(text="x")))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after", "3") in tuple(error.trailing_metadata())

    serve_fake(FakeStreams(refuse=StreamError("capacity", "server is full")), test)


@pytest.mark.parametrize(("fault", "code"), [(RuntimeError("secret internals"), grpc.StatusCode.INTERNAL),
                                             (ActorDiedError(), grpc.StatusCode.UNAVAILABLE)])
def test_server_faults_name_the_request_not_the_internals(fault: BaseException, code: grpc.StatusCode) -> None:
    async def test(channel: grpc.aio.Channel, log: CountingLogger) -> None:
        error = await status_of(pb_grpc.SpecServeStub(channel).Generate(pb.GenerateRequest(text="x", request_id="r-9")))
        assert error.code() == code
        assert "r-9" in error.details() and "secret" not in error.details()

    serve_fake(FakeStreams(fail=fault), test)


def test_100_cancelled_streams_abort_100_requests() -> None:
    async def test(channel: grpc.aio.Channel, log: CountingLogger) -> None:
        stub = pb_grpc.SpecServeStub(channel)
        for index in range(100):
            call = stub.Generate(pb.GenerateRequest(text="x", request_id=f"c-{index}"))
            for _ in range(2):
                await call.read()
            call.cancel()
        for _ in range(200):  # the server sees each cancel asynchronously
            if len(streams.aborted) == 100:
                break
            await asyncio.sleep(0.01)

    streams = FakeStreams(count=10_000)
    serve_fake(streams, test)
    assert sorted(streams.aborted) == sorted(f"c-{index}" for index in range(100))


def test_a_finished_stream_aborts_nothing_and_a_deadline_aborts() -> None:
    async def test(channel: grpc.aio.Channel, log: CountingLogger) -> None:
        stub = pb_grpc.SpecServeStub(channel)
        chunks = [c async for c in stub.Generate(pb.GenerateRequest(text="x", request_id="short"))]
        assert len(chunks) == 5 and chunks[-1].finish_reason == "length"
        error = await status_of(stub.Generate(pb.GenerateRequest(text="x", request_id="late"), timeout=0.2))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(200):
            if streams.aborted:
                break
            await asyncio.sleep(0.01)

    streams = FakeStreams(count=10_000, period_s=0.01)
    serve_fake(streams, test)
    assert streams.aborted == ["late"]


def test_health_checking_and_reflection() -> None:
    async def test(channel: grpc.aio.Channel, log: CountingLogger) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for answer in reflection.ServerReflectionInfo(iter([request])):
            names = {s.name for s in answer.list_services_response.service}
            assert SERVICE_NAME in names and "grpc.health.v1.Health" in names
            break

    serve_fake(FakeStreams(), test)
