"""The gRPC surface `specserve.v1.SpecServe`, served by the ingress replica's own `grpc.aio` server.

Why not Serve's gRPC proxy: the proxy hands the replica a copy of the call's context, so the replica cannot
see the client leave, and the proxy can drop a cancelled stream's close (ray-project/ray#42665): measured,
2-3 of 10 back-to-back cancelled streams ran on to full length. Here the handler runs on the call itself: a
client that cancels, disconnects or passes its deadline cancels the handler's task, whose `finally` aborts
the request at the scheduler.

Every outcome is a status code, never a traceback or UNKNOWN:
  - no API key, or not one of the server's (when it has keys: `authorization: Bearer KEY` metadata) ->
    UNAUTHENTICATED, checked before the message is parsed (cluster/serving/auth.py); Health stays open;
  - a message that does not parse (garbage bytes, invalid UTF-8 in a string field) -> INVALID_ARGUMENT
    (requests arrive as bytes and are parsed here, where a failure is the client's);
  - bad fields -> INVALID_ARGUMENT "field: reason"; a full server -> RESOURCE_EXHAUSTED with a
    `retry-after` trailing metadata (seconds); an unknown `application` metadata -> NOT_FOUND;
  - the call's limit (`specserve-timeout-s` metadata or the server's `request_timeout_s`) -> DEADLINE_EXCEEDED;
  - the scheduler replica gone -> UNAVAILABLE; any other server fault -> INTERNAL with the request id only.
Refusals log one WARNING line (cluster/serving/rejections.py); server faults log their traceback once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from cluster.engine.request_span import FinalChunks, RequestSpan
from cluster.serving.auth import ApiKeys, bearer_token, grpc_peer
from cluster.serving.rejections import RejectionLog
from cluster.serving.streams import ChunkStream, DeadlineExceeded, SchedulerStreams
from cluster.serving.tool_calls import ToolCallStream, ToolOutput, ends_in_calls
from specserve_types.api import InvalidRequestError, SpecServeError
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.protocol import (
    TIMEOUT_METADATA,
    IndexedChunk,
    ServerDefaults,
    StreamError,
    chunk_to_proto,
    request_from_proto,
)

logger = logging.getLogger("ray.serve")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SpecServe"].full_name  # "specserve.v1.SpecServe"
APP_NAME = "specserve"  # the default application name (cluster/serving/app.py)
AUTHORIZATION_METADATA = "authorization"  # "Bearer KEY" (gRPC metadata keys are lower case)
APPLICATION_METADATA = "application"  # optional; when sent it must name this server's application
RETRY_AFTER_METADATA = "retry-after"  # seconds, on RESOURCE_EXHAUSTED (as HTTP's Retry-After)
UNAVAILABLE_ERRORS = (RayActorError, ActorDiedError, ActorUnavailableError)

M = TypeVar("M", bound=Message)


class CallRefused(Exception):
    """A status to end the call with (code, details, trailing metadata); raised inside a handler."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = trailing


def parse(message_type: type[M], data: bytes) -> M:
    try:
        return message_type.FromString(data)
    except (DecodeError, ValueError) as exc:  # garbage, truncation, invalid UTF-8 in a string field
        raise InvalidRequestError("request", f"not a valid {message_type.DESCRIPTOR.full_name} message "
                                             f"({type(exc).__name__})") from None


def call_timeout(metadata: Any, server_limit: float | None) -> float | None:
    """The call's time limit in seconds: its `specserve-timeout-s` metadata, capped by the server's limit.
    (A gRPC deadline needs no copy here: grpc cancels the handler when it passes.)"""
    limit = server_limit
    for key, value in metadata or ():
        if key != TIMEOUT_METADATA:
            continue
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = float("nan")
        if not 0 < seconds < float("inf"):
            raise InvalidRequestError(TIMEOUT_METADATA, f"must be a positive number of seconds, got {value!r}")
        limit = seconds if limit is None else min(limit, seconds)
    return limit


def api_key(metadata: Any) -> str | None:
    """The KEY of the call's `authorization: Bearer KEY` metadata, if any."""
    header = next((value for key, value in metadata or () if key == AUTHORIZATION_METADATA), None)
    return bearer_token(header if isinstance(header, str) else None)


def check_api_key(metadata: Any, keys: ApiKeys) -> None:
    """UNAUTHENTICATED unless the call's `authorization` metadata is `Bearer KEY` with one of `keys` (or none is set)."""
    header = next((value for key, value in metadata or () if key == AUTHORIZATION_METADATA), None)
    if keys.accepts(bearer_token(header if isinstance(header, str) else None)):
        return
    if header is None:
        raise CallRefused(grpc.StatusCode.UNAUTHENTICATED,
                          "missing API key: send the metadata 'authorization: Bearer YOUR_KEY'")
    raise CallRefused(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")


def check_application(metadata: Any, app_name: str = APP_NAME) -> None:
    for key, value in metadata or ():
        if key == APPLICATION_METADATA and value != app_name:
            raise CallRefused(grpc.StatusCode.NOT_FOUND,
                              f"application {value!r} not found; this server serves {app_name!r}")


class ChunkWriter:
    """A request's GenerateChunks. With tools (`tools` not None) each completion's output is read as it streams
    (tool_calls.ToolCallStream, one per completion index): every call goes out in `tool_calls` on the chunk whose
    text completes its block, `text_delta` stays the raw text, and the last chunk's finish_reason is "tool_calls"
    where the HTTP door's would be (tool_calls.ends_in_calls)."""

    def __init__(self, tools: ToolOutput | None = None) -> None:
        self.tools = tools
        self._streams: dict[int, ToolCallStream] = {}

    def chunk(self, item: IndexedChunk) -> pb.GenerateChunk:
        if self.tools is None:
            return chunk_to_proto(item)
        chunk = item.chunk
        stream = self._streams.setdefault(item.index, ToolCallStream())
        events = stream.feed(chunk.text_delta) + (stream.finish() if chunk.finished else [])
        calls = tuple(value for kind, value in events if kind == "call")
        message = chunk_to_proto(dataclasses.replace(item, tool_calls=calls))
        if chunk.finished and ends_in_calls(chunk.finish_reason, stream.calls, self.tools):
            message.finish_reason = "tool_calls"
        return message


class SpecServeService:
    """The four RPCs over a SchedulerStreams; `handler()` registers them on a grpc.aio server."""

    def __init__(self, streams: SchedulerStreams, defaults: ServerDefaults, models: Callable[[], list[dict[str, str]]],
                 rejections: RejectionLog, server_timeout_s: float | None, retry_after_s: int,
                 app_name: str = APP_NAME, keys: ApiKeys | None = None) -> None:
        self._app_name = app_name
        self._keys = keys if keys is not None else ApiKeys()
        self._streams = streams
        self._defaults = defaults
        self._models = models
        self._rejections = rejections
        self._server_timeout_s = server_timeout_s
        self._retry_after = (RETRY_AFTER_METADATA, str(retry_after_s))

    def handler(self) -> grpc.GenericRpcHandler:
        """Requests arrive as bytes (no request deserializer): parse failures become INVALID_ARGUMENT here."""
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, response_serializer=pb.GenerateChunk.SerializeToString),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                self.list_models, response_serializer=pb.ListModelsResponse.SerializeToString),
            "Health": grpc.unary_unary_rpc_method_handler(
                self.health, response_serializer=pb.HealthResponse.SerializeToString),
            "GetStats": grpc.unary_unary_rpc_method_handler(
                self.get_stats, response_serializer=pb.GetStatsResponse.SerializeToString),
        })

    # -- Generate -------------------------------------------------------------------------------------
    async def generate(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        request_id = "-"
        chunks = ChunkStream()
        span = RequestSpan(None)
        finals = FinalChunks()
        try:
            metadata = context.invocation_metadata()
            check_api_key(metadata, self._keys)
            check_application(metadata, self._app_name)
            request = parse(pb.GenerateRequest, data)
            request_id = request.request_id or "-"
            timeout_s = call_timeout(metadata, self._server_timeout_s)
            args, tools = request_from_proto(request, self._defaults)
            writer = ChunkWriter(tools)
            request_id = args.request_id
            span = RequestSpan.start("chat" if args.chat else "text_completion", self._defaults.model, args.sampling,
                                     request_id, parent=metadata, n=args.n)
            client = self._keys.client(api_key(metadata), grpc_peer(context.peer()))  # a key's id, or the channel's
            args = dataclasses.replace(args, trace_context=span.carrier(), client=client)
            error, chunks = await self._streams.open(args, timeout_s)
            if error is not None:
                self._refuse(request_id, error)
            async for item in chunks:
                finals.add(item)
                yield writer.chunk(item)
            span.finish(self._defaults.model, finals.stats(), finals.reasons())
        except Exception as exc:  # asyncio.CancelledError (the client left) is a BaseException: not caught
            status = self._status(request_id, exc)
            span.fail(status.code.name, status.details)
            await self._end(context, status)
        except BaseException:
            span.fail("cancelled", "the client left")
            raise
        finally:
            chunks.cancel()  # leaving early (cancel, disconnect, deadline, error) aborts the request at the scheduler

    # -- unary calls ------------------------------------------------------------------------------------
    async def list_models(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        async def answer() -> pb.ListModelsResponse:
            parse(pb.ListModelsRequest, data)
            return pb.ListModelsResponse(models=[pb.ModelInfo(**model) for model in self._models()])
        return await self._unary(context, answer, needs_key=True)

    async def health(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        async def answer() -> pb.HealthResponse:
            parse(pb.HealthRequest, data)
            ok, status = await self._streams.health()
            return pb.HealthResponse(ok=ok, status=status)
        return await self._unary(context, answer)

    async def get_stats(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        async def answer() -> pb.GetStatsResponse:
            parse(pb.GetStatsRequest, data)
            stats = await self._streams.stats()
            return pb.GetStatsResponse(stats_json=json.dumps(stats, sort_keys=True, default=str))
        return await self._unary(context, answer, needs_key=True)

    async def _unary(self, context: grpc.aio.ServicerContext, answer: Callable[[], Awaitable[M]],
                     needs_key: bool = False) -> M:
        """A unary call; Health (needs_key False) answers without a key, like the gRPC health service."""
        try:
            if needs_key:
                check_api_key(context.invocation_metadata(), self._keys)
            check_application(context.invocation_metadata(), self._app_name)
            return await answer()
        except Exception as exc:
            await self._end(context, self._status("-", exc))

    # -- statuses ---------------------------------------------------------------------------------------
    def _refuse(self, request_id: str, error: StreamError) -> NoReturn:
        if error.code == "invalid":
            raise InvalidRequestError(error.field or "request", error.message)
        if error.code == "capacity":
            self._rejections.rejected(request_id, "RESOURCE_EXHAUSTED", None, error.message)
            raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, error.describe(), (self._retry_after,))
        raise SpecServeError(error.message)

    def _status(self, request_id: str, exc: Exception) -> CallRefused:
        """The status that ends a call after `exc`; refusals are logged as one line, faults with a traceback."""
        if isinstance(exc, CallRefused):
            if exc.code == grpc.StatusCode.NOT_FOUND:
                self._rejections.rejected(request_id, exc.code.name, APPLICATION_METADATA, exc.details)
            elif exc.code == grpc.StatusCode.UNAUTHENTICATED:  # the details name no key
                self._rejections.rejected(request_id, exc.code.name, AUTHORIZATION_METADATA, exc.details)
            return exc
        if isinstance(exc, InvalidRequestError):
            self._rejections.rejected(request_id, "INVALID_ARGUMENT", exc.field, exc.message)
            return CallRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if isinstance(exc, DeadlineExceeded):
            logger.info("request %r: call deadline passed, request aborted", request_id)
            return CallRefused(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded; the request was aborted")
        if isinstance(exc, UNAVAILABLE_ERRORS):
            logger.warning("request %r: scheduler unavailable: %s", request_id, type(exc).__name__)
            return CallRefused(grpc.StatusCode.UNAVAILABLE, f"scheduler unavailable; retry (request id {request_id})")
        if isinstance(exc, SpecServeError):  # an internal error reported by the scheduler (already logged there)
            logger.warning("request %r failed: %s", request_id, exc)
        else:
            logger.exception("request %r: internal error in the gRPC ingress", request_id)
        return CallRefused(grpc.StatusCode.INTERNAL, f"internal server error (request id {request_id})")

    @staticmethod
    async def _end(context: grpc.aio.ServicerContext, status: CallRefused) -> NoReturn:
        if status.trailing:
            context.set_trailing_metadata(status.trailing)
        await context.abort(status.code, status.details)
