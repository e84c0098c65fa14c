"""The OpenAI-compatible HTTP API over a SchedulerStreams (the ingress's FastAPI routes call these).

Bodies are parsed and formatted in cluster/serving/openai_api.py; errors answer OpenAI's error body:
invalid -> 400, capacity -> 429, internal -> 500 (with the request id only). Leaving a stream early
(the client disconnects) cancels it, which aborts the request at the scheduler.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.serving.openai_api import (
    SSE_DONE,
    Collected,
    completion_body,
    error_body,
    parse_chat,
    parse_completion,
    sse_event,
)
from cluster.serving.rejections import RejectionLog
from cluster.serving.streams import ChunkStream, SchedulerStreams
from specserve_types.api import InvalidRequestError, SpecServeError
from specserve_types.protocol import GenerateArgs, ServerDefaults, StreamError

logger = logging.getLogger("ray.serve")

HTTP_ERRORS = {"invalid": (400, "invalid_request_error"), "capacity": (429, "capacity_error"),
               "internal": (500, "internal_error")}


class OpenAIFrontEnd:
    def __init__(self, streams: SchedulerStreams, defaults: ServerDefaults, models: Callable[[], list[dict[str, str]]],
                 rejections: RejectionLog, retry_after_s: int) -> None:
        self._streams = streams
        self._defaults = defaults
        self._models = models
        self._rejections = rejections
        self._retry_after_s = retry_after_s

    def error(self, error: StreamError, request_id: str = "-") -> JSONResponse:
        status, kind = HTTP_ERRORS[error.code]
        headers = {}
        if error.code == "capacity":
            headers["Retry-After"] = str(self._retry_after_s)
        if error.code != "internal":
            self._rejections.rejected(request_id, str(status), error.field, error.message)
        return JSONResponse(error_body(error.describe(), kind, error.field), status_code=status, headers=headers)

    async def generate(self, request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
        except ValueError as exc:
            return self.error(StreamError("invalid", f"not valid JSON: {exc}", "body"))
        try:
            args = (parse_chat if chat else parse_completion)(body, self._defaults)
            error, chunks = await self._streams.open(args)
        except InvalidRequestError as exc:
            return self.error(StreamError.of(exc))
        if error is not None:
            return self.error(error, args.request_id)
        if body.get("stream"):
            return StreamingResponse(self._sse(args, chunks, chat), media_type="text/event-stream")
        collected = Collected(n=args.n)
        try:
            async for item in chunks:
                collected.add(item)
        except SpecServeError as exc:
            return self.error(StreamError("internal", str(exc)), args.request_id)
        finally:
            chunks.cancel()
        return JSONResponse(completion_body(args.request_id, self._defaults.model, collected, chat))

    async def _sse(self, args: GenerateArgs, chunks: ChunkStream, chat: bool) -> AsyncIterator[str]:
        started: set[int] = set()
        try:
            async for item in chunks:
                yield sse_event(args.request_id, self._defaults.model, item, chat, first=item.index not in started)
                started.add(item.index)
        except SpecServeError as exc:
            yield f"data: {json.dumps(error_body(str(exc), 'internal_error'))}\n\n"
        finally:
            chunks.cancel()
        yield SSE_DONE

    def models(self) -> dict[str, Any]:
        created = int(time.time())
        return {"object": "list", "data": [{"id": m["id"], "object": "model", "created": created,
                                            "owned_by": "specserve", "role": m["role"], "draft": m["draft"]}
                                           for m in self._models() if m["role"] == "target"]}

    async def health(self) -> JSONResponse:
        ok, status = await self._streams.health()
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    async def stats(self) -> dict[str, Any]:
        return await self._streams.stats()
