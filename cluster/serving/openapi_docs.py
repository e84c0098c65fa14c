"""What /openapi.json says about each HTTP route: the keyword arguments of its FastAPI decorator, and
`document(app)`, which adds the request and stream models to the schema's components.

The generation routes read their bodies themselves (bounded, cluster/serving/json_body.py; parsed by the
models in cluster/serving/openai_models.py), so FastAPI never validates them (no 422s); the request body
schema is declared here instead, from the same models. A 200 is `application/json` (the response model) or,
with `stream: true`, `text/event-stream`, whose schema describes one event, as Open API 3.1 reads it: `data`
is `[DONE]` or a JSON chunk (or an error body, should the stream fail after it started).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, PlainTextResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from cluster.serving.json_body import MAX_BODY_BYTES, MAX_JSON_DEPTH
from cluster.serving.openai_models import (
    REQUEST_MODELS,
    STREAM_MODELS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelList,
    StatsResponse,
)

COMPONENTS = "#/components/schemas/{model}"


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": COMPONENTS.format(model=model.__name__)}


def sse_event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event: `data` is `[DONE]`, or a JSON chunk / error body."""
    payload = {"contentMediaType": "application/json",
               "contentSchema": {"anyOf": [ref(chunk), ref(ErrorResponse)]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"type": "string", "if": {"const": "[DONE]"}, "then": True, "else": payload}},
            "description": f"one event: `data: <{chunk.__name__} as JSON>`; the last is `data: [DONE]`"}


RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
REQUEST_ID = {"x-specserve-request-id": {"description": "the request's id (also in a 500's message)",
                               "schema": {"type": "string"}}}
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request: `error.param` names the field, the message "
                                                 f"starts with it (`body`: not JSON, nested over {MAX_JSON_DEPTH})",
          "headers": REQUEST_ID},
    401: {"model": ErrorResponse, "description": "no API key or not one of the server's (when it has keys; "
                                                 "`code: invalid_api_key`)", "headers": REQUEST_ID},
    413: {"model": ErrorResponse, "description": f"body larger than {MAX_BODY_BYTES} bytes", "headers": REQUEST_ID},
    429: {"model": ErrorResponse, "description": "the server is full", "headers": {**RETRY_AFTER, **REQUEST_ID}},
    500: {"model": ErrorResponse, "description": "server fault: the message holds the request id only",
          "headers": REQUEST_ID},
    503: {"model": ErrorResponse, "description": "the scheduler is unavailable (being restarted)",
          "headers": {**RETRY_AFTER, **REQUEST_ID}},
}


def generation_route(request: type[BaseModel], response: type[BaseModel], chunk: type[BaseModel],
                     summary: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "responses": {200: {"model": response, "headers": REQUEST_ID,
                            "description": "the completion; with `stream: true` server-sent events",
                            "content": {"text/event-stream": {"schema": sse_event_schema(chunk)}}},
                      **ERRORS},
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}}},
    }


COMPLETIONS_ROUTE = generation_route(CompletionRequest, CompletionResponse, CompletionChunk, "Text completion")
CHAT_ROUTE = generation_route(ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk, "Chat completion")
MODELS_ROUTE: dict[str, Any] = {"summary": "The served model", "responses": {200: {"model": ModelList}, 401: ERRORS[401]}}
HEALTH_ROUTE: dict[str, Any] = {"summary": "Health of the scheduler and its workers",
                                "responses": {200: {"model": HealthResponse},
                                              503: {"model": HealthResponse, "description": "not healthy"}}}
METRICS_ROUTE: dict[str, Any] = {
    "summary": "Prometheus metrics (text format), vLLM's spec_decode counters under vLLM's names",
    "response_class": PlainTextResponse,
    "responses": {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                        "description": "Prometheus text exposition format 0.0.4"},
                  401: ERRORS[401], 500: ERRORS[500], 503: ERRORS[503]}}
STATS_ROUTE: dict[str, Any] = {"summary": "Scheduler, engine and KV statistics",
                               "responses": {200: {"model": StatsResponse}, 401: ERRORS[401],
                                             500: ERRORS[500], 503: ERRORS[503]}}


# The browsable pages over /openapi.json (FastAPI's own are off: `docs_url=None, redoc_url=None`): served by the
# ingress's routes, behind the API key when the server has keys (cluster/serving/http_api.py, docs_page)
DOCS_PAGES = ("/docs", "/redoc")


def docs_html(path: str, root_path: str = "", title: str = "specserve") -> HTMLResponse:
    """Swagger UI (/docs) or ReDoc (/redoc) reading `root_path`/openapi.json, as FastAPI's own pages do."""
    openapi_url = f"{root_path.rstrip('/')}/openapi.json"
    if path == "/redoc":
        return get_redoc_html(openapi_url=openapi_url, title=f"{title} - ReDoc")
    return get_swagger_ui_html(openapi_url=openapi_url, title=f"{title} - Swagger UI")


def document(app: FastAPI) -> None:
    """Make `app.openapi()` include the request and stream models (referenced by the routes above)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes, servers=app.servers)
            models = [(m, "validation") for m in REQUEST_MODELS] + [(m, "serialization") for m in STREAM_MODELS]
            _, definitions = models_json_schema(models, ref_template=COMPONENTS)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
