"""The Ingress deployment: the gRPC SpecServe service and the OpenAI-compatible HTTP API, one replica class.

Both front ends validate at once (InvalidRequestError -> INVALID_ARGUMENT / HTTP 400, the field named
first in the message), then stream from the Scheduler. A refusal from the scheduler arrives as the
stream's first item (capacity -> RESOURCE_EXHAUSTED / HTTP 429), before anything is sent to the
client. Leaving the stream early (disconnect, deadline) cancels the scheduler call, which aborts the
request in the engine.

Deadlines: a gRPC deadline never reaches a Serve replica (the proxy keeps it), and the proxy does not
always pass a client's departure on (ray-project/ray#42665). So a gRPC call also states its time limit
in the `specserve-timeout-s` metadata (the Python client sends its timeout there); the ingress keeps
that limit itself, capped by the server's `request_timeout_s`, aborts the request at the scheduler
when it passes and ends the call with DEADLINE_EXCEEDED.
"""

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from cluster.serving.config import ClusterConfig
from cluster.serving.openai_api import (
    SSE_DONE,
    Collected,
    completion_body,
    error_body,
    parse_chat,
    parse_completion,
    sse_event,
)
from specserve_types.api import InvalidRequestError, SpecServeError
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.protocol import (
    TIMEOUT_METADATA,
    GenerateArgs,
    IndexedChunk,
    ServerDefaults,
    StreamError,
    args_from_proto,
    chunk_to_proto,
)

logger = logging.getLogger("ray.serve")

GRPC_CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "capacity": grpc.StatusCode.RESOURCE_EXHAUSTED,
              "internal": grpc.StatusCode.INTERNAL}
HTTP_ERRORS = {"invalid": (400, "invalid_request_error"), "capacity": (429, "capacity_error"),
               "internal": (500, "internal_error")}

http_app = FastAPI(title="specserve", description="OpenAI-compatible speculative-decoding server")


class RequestRefused(SpecServeError):
    """Raised after the gRPC status is set on the context; one message argument, so Ray can pickle it."""


class DeadlineExceeded(SpecServeError, TimeoutError):
    """The call's time limit passed before its last chunk (the request was aborted)."""


def call_timeout(metadata: Any, server_limit: float | None) -> float | None:
    """The call's time limit in seconds: its `specserve-timeout-s` metadata, capped by the server's limit."""
    limit = server_limit
    for key, value in metadata or ():
        if key != TIMEOUT_METADATA:
            continue
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not 0 < seconds < float("inf"):
            raise InvalidRequestError(TIMEOUT_METADATA, f"{TIMEOUT_METADATA} must be a positive number of seconds, "
                                                        f"got {value!r}")
        limit = seconds if limit is None else min(limit, seconds)
    return limit


class ChunkStream:
    """One request's chunks from the scheduler. `cancel()` is synchronous and idempotent, so a consumer's
    `finally` reaches the scheduler at once (an abandoned async generator would only be closed whenever the
    garbage collector finalises it, and the request would run to its end)."""

    def __init__(self, stream: Any = None, first: IndexedChunk | None = None,
                 abort: Callable[[], Any] | None = None, deadline: float | None = None) -> None:
        self._stream = stream
        self._first = first
        self._abort = abort  # tells the scheduler directly (a second path besides the stream's cancel)
        self._deadline = deadline  # time.monotonic() after which the request is aborted
        self._done = stream is None

    def __aiter__(self) -> "ChunkStream":
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


def deadline_exceeded(grpc_context: Any, timeout_s: float | None) -> NoReturn:
    logger.info("call deadline of %.3fs passed: request aborted", timeout_s or 0.0)
    grpc_context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
    grpc_context.set_details(f"deadline of {timeout_s}s exceeded; the request was aborted")
    raise RequestRefused(f"deadline of {timeout_s}s exceeded")


async def until(awaitable: Any, deadline: float | None) -> Any:
    """Await `awaitable`, or raise DeadlineExceeded once time.monotonic() passes `deadline`."""
    if deadline is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise DeadlineExceeded("deadline exceeded") from None


def http_error(error: StreamError) -> JSONResponse:
    status, kind = HTTP_ERRORS[error.code]
    return JSONResponse(error_body(error.describe(), kind, error.field), status_code=status)


@serve.ingress(http_app)
class Ingress:
    # No `from __future__ import annotations` here: FastAPI reads the route signatures at runtime.
    def __init__(self, config: ClusterConfig, scheduler: Any) -> None:
        self._config = config
        self._scheduler = scheduler
        self._defaults = ServerDefaults(config.model, "model" if config.uses_draft_model else "ngram")

    async def _open(self, args: GenerateArgs,
                    timeout_s: float | None = None) -> "tuple[StreamError | None, ChunkStream]":
        """Start the scheduler stream; a refusal is returned before the first chunk is."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stream = self._scheduler.options(stream=True).generate.remote(args)
        try:
            first = await until(stream.__anext__(), deadline)
        except BaseException:  # the client left, the deadline passed or the call failed before the first chunk
            stream.cancel()
            self._scheduler.abort.remote(args.request_id)
            raise
        if isinstance(first, StreamError):
            stream.cancel()
            return first, ChunkStream()
        return None, ChunkStream(stream, first, abort=lambda: self._scheduler.abort.remote(args.request_id),
                                 deadline=deadline)

    # -- gRPC (method names = rpc names of specserve.v1.SpecServe) ----------------------------------
    async def Generate(self, request: pb.GenerateRequest, grpc_context: Any) -> AsyncIterator[pb.GenerateChunk]:
        try:
            timeout_s = call_timeout(grpc_context.invocation_metadata(), self._config.request_timeout_s)
            args = args_from_proto(request, self._defaults)
            error, chunks = await self._open(args, timeout_s)
        except InvalidRequestError as exc:
            error, chunks = StreamError.of(exc), ChunkStream()
        except DeadlineExceeded:
            deadline_exceeded(grpc_context, timeout_s)
        if error is not None:
            grpc_context.set_code(GRPC_CODES[error.code])
            grpc_context.set_details(error.describe())
            raise RequestRefused(error.describe())
        try:
            async for item in chunks:
                yield chunk_to_proto(item)
        except DeadlineExceeded:
            deadline_exceeded(grpc_context, timeout_s)
        except SpecServeError as exc:
            grpc_context.set_code(grpc.StatusCode.INTERNAL)
            grpc_context.set_details(str(exc))
            raise RequestRefused(str(exc)) from None
        finally:
            chunks.cancel()  # leaving early (disconnect, deadline) aborts the request at the scheduler

    async def ListModels(self, request: pb.ListModelsRequest) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelInfo(**model) for model in self._models()])

    async def Health(self, request: pb.HealthRequest) -> pb.HealthResponse:
        ok, status = await self._scheduler.health.remote()
        return pb.HealthResponse(ok=ok, status=status)

    async def GetStats(self, request: pb.GetStatsRequest) -> pb.GetStatsResponse:
        stats = await self._scheduler.stats.remote()
        return pb.GetStatsResponse(stats_json=json.dumps(stats, sort_keys=True, default=str))

    def _models(self) -> list[dict[str, str]]:
        models = [{"id": self._config.model, "role": "target", "draft": self._config.draft}]
        if self._config.uses_draft_model:
            models.append({"id": self._config.draft, "role": "draft", "draft": ""})
        return models

    # -- HTTP (OpenAI-compatible) -------------------------------------------------------------------
    @http_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._http_generate(request, chat=False)

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._http_generate(request, chat=True)

    @http_app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        created = int(time.time())
        return {"object": "list", "data": [{"id": m["id"], "object": "model", "created": created,
                                            "owned_by": "specserve", "role": m["role"], "draft": m["draft"]}
                                           for m in self._models() if m["role"] == "target"]}

    @http_app.get("/health")
    async def health(self) -> JSONResponse:
        ok, status = await self._scheduler.health.remote()
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    @http_app.get("/v1/stats")
    async def stats(self) -> dict[str, Any]:
        return await self._scheduler.stats.remote()

    async def _http_generate(self, request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
        except ValueError as exc:
            return http_error(StreamError("invalid", f"not valid JSON: {exc}", "body"))
        try:
            args = (parse_chat if chat else parse_completion)(body, self._defaults)
            error, chunks = await self._open(args)
        except InvalidRequestError as exc:
            error, chunks = StreamError.of(exc), ChunkStream()
        if error is not None:
            return http_error(error)
        if body.get("stream"):
            return StreamingResponse(self._sse(args, chunks, chat), media_type="text/event-stream")
        collected = Collected(n=args.n)
        try:
            async for item in chunks:
                collected.add(item)
        except SpecServeError as exc:
            return http_error(StreamError("internal", str(exc)))
        finally:
            chunks.cancel()
        return JSONResponse(completion_body(args.request_id, self._config.model, collected, chat))

    async def _sse(self, args: GenerateArgs, chunks: ChunkStream, chat: bool) -> AsyncIterator[str]:
        started: set[int] = set()
        try:
            async for item in chunks:
                yield sse_event(args.request_id, self._config.model, item, chat, first=item.index not in started)
                started.add(item.index)
        except SpecServeError as exc:
            yield f"data: {json.dumps(error_body(str(exc), 'internal_error'))}\n\n"
        finally:
            chunks.cancel()
        yield SSE_DONE


IngressDeployment = serve.deployment(Ingress, name="Ingress")
