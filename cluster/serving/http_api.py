"""The OpenAI-compatible HTTP API over a SchedulerStreams (the ingress's FastAPI routes call these).

Bodies are read within bounds (cluster/serving/json_body.py), parsed and formatted in
cluster/serving/openai_api.py. Every answer that is not a 200 is OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`, and no input gets a 5xx:
    400 invalid_request_error  the client's fault; `param` names the field and the message starts with it
    413 invalid_request_error  a body over json_body.MAX_BODY_BYTES (`param: "body"`)
    429 capacity_error         the scheduler's queue is full; `Retry-After` says when to try again
    503 unavailable_error      the scheduler replica is gone (Serve restarts it); `Retry-After` as well
    500 internal_error         a server fault: the message holds the request id only, the log has the rest
    401 invalid_request_error  no API key, or not one of the server's (`code: invalid_api_key`, `WWW-Authenticate`);
                               checked before the body is read, so nothing reaches the scheduler (cluster/serving/auth.py)
Open without a key: /health, /metrics (unless `metrics_require_api_key`), /openapi.json (the schema is public);
/docs and /redoc only when the server has no keys (docs/security.md, "Open by design").
Each answer of a generation route carries the request id in `x-specserve-request-id`. A refusal (400, 413, 429) is one
WARNING line (cluster/serving/rejections.py); a server fault logs its traceback once. Leaving a stream early
(the client disconnects) cancels it, which aborts the request at the scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from starlette.requests import ClientDisconnect

from cluster.engine.request_span import RequestSpan
from cluster.serving.auth import ApiKeys, bearer_token, http_peer
from cluster.serving.json_body import BodyError, parse_json, read_body
from cluster.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from cluster.serving.openai_api import (
    SSE_DONE,
    Collected,
    OpenAIRequest,
    SSEWriter,
    completion_body,
    error_body,
    parse_request,
    sse_data,
    usage_event,
)
from cluster.serving.openapi_docs import docs_html
from cluster.serving.rejections import RejectionLog
from cluster.serving.streams import ChunkStream, SchedulerStreams
from specserve_types.api import CapacityError, InvalidRequestError, SpecServeError
from specserve_types.protocol import ServerDefaults, new_request_id

logger = logging.getLogger("ray.serve")

UNAVAILABLE_ERRORS = (RayActorError, ActorDiedError, ActorUnavailableError)
REQUEST_ID_HEADER = "x-specserve-request-id"  # Serve's proxy sets its own x-request-id


class OpenAIFrontEnd:
    def __init__(self, streams: SchedulerStreams, defaults: ServerDefaults, models: Callable[[], list[dict[str, str]]],
                 rejections: RejectionLog, retry_after_s: int, keys: ApiKeys | None = None,
                 metrics_need_key: bool = False) -> None:
        self._keys = keys if keys is not None else ApiKeys()
        self._metrics_need_key = metrics_need_key
        self._streams = streams
        self._defaults = defaults
        self._models = models
        self._rejections = rejections
        self._retry_after_s = retry_after_s

    # -- answers that are not a 200 ---------------------------------------------------------------------
    def unauthorized(self, request: Request) -> JSONResponse | None:
        """None when the request may pass; else OpenAI's 401 and one WARNING line (never the key)."""
        header = request.headers.get("authorization")
        if self._keys.accepts(bearer_token(header)):
            return None
        request_id = new_request_id()
        reason = "missing API key" if header is None else "invalid API key"
        self._rejections.rejected(request_id, "401", "authorization", reason)
        message = ("missing API key: send the header 'Authorization: Bearer YOUR_KEY'" if header is None
                   else "invalid API key (the Authorization header must be 'Bearer ' and one of the server's keys)")
        return JSONResponse(error_body(message, "invalid_request_error", None, "invalid_api_key"), status_code=401,
                            headers={"WWW-Authenticate": 'Bearer realm="specserve"', REQUEST_ID_HEADER: request_id})

    def refusal(self, request_id: str, status: int, kind: str, message: str,
                param: str | None) -> tuple[int, dict[str, Any], dict[str, str]]:
        """A refusal (the client's doing or a full server): one WARNING line, OpenAI's error body."""
        self._rejections.rejected(request_id, str(status), param, message)
        headers = {REQUEST_ID_HEADER: request_id}
        if status == 429:
            headers["Retry-After"] = str(self._retry_after_s)
        return status, error_body(f"{param}: {message}" if param else message, kind, param), headers

    def answer(self, request_id: str, exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
        """(status, error body, headers) after `exc` was raised serving a request; refusals are logged as one
        line, faults with their traceback, and a server fault's body holds the request id, never the exception."""
        if isinstance(exc, BodyError):
            return self.refusal(request_id, exc.status, "invalid_request_error", exc.message, "body")
        if isinstance(exc, ClientDisconnect):  # no one will read the answer; the log says why the request ended
            return self.refusal(request_id, 400, "invalid_request_error", "the client left while sending it", "body")
        if isinstance(exc, InvalidRequestError):
            return self.refusal(request_id, 400, "invalid_request_error", exc.message, exc.field)
        if isinstance(exc, CapacityError):
            return self.refusal(request_id, 429, "capacity_error", str(exc) or "server is full", None)
        headers = {REQUEST_ID_HEADER: request_id}
        if isinstance(exc, UNAVAILABLE_ERRORS):
            logger.warning("request %s: scheduler unavailable: %s", request_id, type(exc).__name__)
            headers["Retry-After"] = str(self._retry_after_s)
            return 503, error_body(f"scheduler unavailable; retry (request id {request_id})", "unavailable_error"), headers
        if isinstance(exc, SpecServeError):  # an internal error the scheduler reported (and logged)
            logger.warning("request %s failed: %s", request_id, exc)
        else:
            logger.error("request %s: internal error in the HTTP ingress", request_id, exc_info=exc)
        return 500, error_body(f"internal server error (request id {request_id})", "internal_error"), headers

    def fault(self, request_id: str, exc: BaseException, span: RequestSpan | None = None) -> JSONResponse:
        status, body, headers = self.answer(request_id, exc)
        if span is not None:
            span.fail(str(status), body["error"]["message"])
        return JSONResponse(body, status_code=status, headers=headers)

    # -- generation ---------------------------------------------------------------------------------------
    async def generate(self, request: Request, chat: bool) -> Response:
        if (refused := self.unauthorized(request)) is not None:
            return refused
        request_id = new_request_id()
        span = RequestSpan(None)
        try:
            body = parse_json(await read_body(request.headers, request.stream()))
            parsed = parse_request(body, self._defaults, chat, request_id)
            span = RequestSpan.start("chat" if chat else "text_completion", self._defaults.model,
                                     parsed.args.sampling, request_id, parent=request.headers.items(), n=parsed.args.n)
            client = self._keys.client(bearer_token(request.headers.get("authorization")),  # a key's id, or
                                       http_peer(request.client))  # the connection's
            parsed = dataclasses.replace(parsed, args=dataclasses.replace(parsed.args, trace_context=span.carrier(),
                                                                          client=client))
            error, chunks = await self._streams.open(parsed.args)
            if error is not None:
                raise error.to_exception()
        except Exception as exc:  # asyncio.CancelledError (the client left) is a BaseException: not caught
            return self.fault(request_id, exc, span)
        headers = {REQUEST_ID_HEADER: request_id}
        if parsed.stream:
            return StreamingResponse(self._sse(parsed, chunks, chat, span), media_type="text/event-stream",
                                     headers=headers)
        collected = Collected(n=parsed.args.n)
        try:
            async for item in chunks:
                collected.add(item)
        except Exception as exc:
            return self.fault(request_id, exc, span)
        except BaseException:
            span.fail("cancelled", "the client left")
            raise
        finally:
            chunks.cancel()
        collected.finish_span(span, self._defaults.model)
        return JSONResponse(completion_body(request_id, self._defaults.model, collected, chat, parsed.tools, parsed.view),
                            headers=headers)

    async def _sse(self, parsed: OpenAIRequest, chunks: ChunkStream, chat: bool,
                   span: RequestSpan) -> AsyncIterator[str]:
        request_id, model = parsed.args.request_id, self._defaults.model
        collected = Collected(n=parsed.args.n)
        writer = SSEWriter(request_id, model, chat, parsed.include_usage, parsed.tools, parsed.view)
        try:
            async for item in chunks:
                collected.add(item)
                for event in writer.events(item):
                    yield event
            collected.finish_span(span, model)
            if parsed.include_usage:
                yield usage_event(request_id, model, collected, chat)
        except Exception as exc:  # the status line is sent: the error travels as an event
            status, body, _ = self.answer(request_id, exc)
            span.fail(str(status), body["error"]["message"])
            yield sse_data(body)
        except BaseException:
            span.fail("cancelled", "the client left")
            raise
        finally:
            chunks.cancel()
        yield SSE_DONE

    # -- the other routes ---------------------------------------------------------------------------------
    def models(self, request: Request) -> Response:
        if (refused := self.unauthorized(request)) is not None:
            return refused
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [{"id": m["id"], "object": "model", "created": created,
                                            "owned_by": "specserve", "role": m["role"], "draft": m["draft"]}
                                           for m in self._models() if m["role"] == "target"]})

    def docs_page(self, request: Request, path: str) -> Response:
        """/docs or /redoc: behind the key when the server has keys, like every route but the probes' (a browser
        sends no key, so there they are closed: read the open /openapi.json with any viewer); open otherwise."""
        if (refused := self.unauthorized(request)) is not None:
            return refused
        return docs_html(path, request.scope.get("root_path", ""))

    async def health(self) -> JSONResponse:
        try:
            ok, status = await self._streams.health()
        except Exception as exc:  # the scheduler's own health check restarts it
            logger.warning("health: scheduler unavailable: %s", type(exc).__name__)
            ok, status = False, "scheduler unavailable"
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        """Prometheus text of the scheduler's metrics (cluster/serving/metrics.py), vLLM's names included; open
        unless the server asks a key for it (`metrics_require_api_key`)."""
        if self._metrics_need_key and (refused := self.unauthorized(request)) is not None:
            return refused
        try:
            return Response(await self._streams.metrics_text(), media_type=METRICS_CONTENT_TYPE)
        except Exception as exc:
            return self.fault("-", exc)

    async def stats(self, request: Request) -> Response:
        if (refused := self.unauthorized(request)) is not None:
            return refused
        try:
            return JSONResponse(await self._streams.stats())
        except Exception as exc:
            return self.fault("-", exc)

