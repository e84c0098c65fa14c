"""The Ingress deployment: the gRPC SpecServe service and the OpenAI-compatible HTTP API, one replica class.

    gRPC   the replica's own grpc.aio server on `grpc_port` (cluster/serving/grpc_server.py): SpecServe,
           health checking, reflection. Not Serve's gRPC proxy: see cluster/serving/grpc_service.py.
    HTTP   FastAPI routes behind Serve's HTTP proxy (cluster/serving/http_api.py).

Both front ends check the API key first, when the server has keys (cluster/serving/auth.py: HTTP 401 /
gRPC UNAUTHENTICATED, nothing sent to the scheduler; /health and the health services stay open), and serve TLS
when given a certificate (gRPC here, HTTP through Serve's proxy options: cluster/serving/app.py). They then
validate at once (InvalidRequestError -> INVALID_ARGUMENT / HTTP 400, the field named
first in the message), then stream from the Scheduler (cluster/serving/streams.py; with the round channels the
scheduler pushes the chunks to this replica's chunk inbox over a socket: cluster/serving/chunk_push.py). A refusal
from the scheduler arrives as the stream's first item (capacity -> RESOURCE_EXHAUSTED / HTTP 429, with a retry
hint), before anything is sent to the client. Leaving the stream early (disconnect, cancel, deadline)
aborts the request at the scheduler.
"""

import logging
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from cluster.serving.auth import ApiKeys, AuthError
from cluster.serving.chunk_push import ChunkInbox
from cluster.serving.config import ClusterConfig
from cluster.serving.grpc_server import GrpcServer, read_tls_pair
from cluster.serving.grpc_service import SpecServeService
from cluster.serving.http_api import OpenAIFrontEnd
from cluster.serving.openapi_docs import (
    CHAT_ROUTE,
    COMPLETIONS_ROUTE,
    DOCS_PAGES,
    HEALTH_ROUTE,
    METRICS_ROUTE,
    MODELS_ROUTE,
    STATS_ROUTE,
    document,
)
from cluster.serving.rejections import RejectionLog
from cluster.serving.streams import SchedulerStreams
from specserve_types.protocol import ServerDefaults
from specserve_types.tracing import configure_tracing, shutdown_tracing

logger = logging.getLogger("ray.serve")


async def open_inbox(config: ClusterConfig) -> ChunkInbox | None:
    """This replica's chunk inbox (cluster/serving/chunk_push.py) with the round channels (`round_transport:
    channel`); None with `round_transport: ray` (every chunk through Serve's streaming call, as before)."""
    if config.round_transport != "channel":
        return None
    inbox = ChunkInbox(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
    await inbox.start()
    return inbox


# FastAPI's own /docs and /redoc are off: the routes below serve them, behind the key when the server has keys
http_app = FastAPI(title="specserve", description="OpenAI-compatible speculative-decoding server", docs_url=None,
                   redoc_url=None)


@serve.ingress(http_app)
class Ingress:
    # No `from __future__ import annotations` here: FastAPI reads the route signatures at runtime.
    async def __init__(self, config: ClusterConfig, scheduler: Any) -> None:
        self._config = config
        configure_tracing(config.tracing_settings(), "specserve-ingress")  # request spans (off unless configured)
        self._inbox = await open_inbox(config)
        streams = SchedulerStreams(scheduler, self._inbox)
        self._streams = streams
        defaults = ServerDefaults(config.model, "model" if config.uses_draft_model else config.draft,
                                  config.request_limits())
        rejections = RejectionLog(logger)
        self._keys = ApiKeys(config.key_sources())  # AuthError (unreadable file, short key) fails the replica
        logger.info("API keys: %s", f"{len(self._keys)} accepted" if self._keys.enabled else "none (open)")
        self._http = OpenAIFrontEnd(streams, defaults, self._models, rejections, config.retry_after_s, self._keys,
                                    config.metrics_require_api_key)
        # the Serve application this replica belongs to: what the `application` metadata must name
        service = SpecServeService(streams, defaults, self._models, rejections, config.request_timeout_s,
                                   config.retry_after_s, app_name=serve.get_replica_context().app_name,
                                   keys=self._keys)
        tls = None
        if config.tls_cert_file and config.tls_key_file:
            tls = read_tls_pair(config.tls_cert_file, config.tls_key_file)
        self._grpc = GrpcServer(service, config.host, config.grpc_port, tls)
        await self._grpc.start()

    def _models(self) -> list[dict[str, str]]:
        models = [{"id": self._config.model, "role": "target", "draft": self._config.draft}]
        if self._config.uses_draft_model:
            models.append({"id": self._config.draft, "role": "draft", "draft": ""})
        return models

    async def check_health(self) -> None:
        """Serve's periodic health check; also keeps the gRPC health service's status current and re-reads a
        changed API key file (a rotated Secret; a broken one keeps the keys in force and is logged)."""
        try:
            if self._keys.reload():
                logger.info("API keys re-read: %d accepted", len(self._keys))
        except AuthError as exc:
            logger.error("API keys not re-read, the previous ones stay: %s", exc)
        try:
            ok, _ = await self._streams.health()
        except Exception:  # the scheduler's own health check restarts it; this replica is fine
            ok = False
        await self._grpc.set_serving(ok)

    async def __del__(self) -> None:
        if (server := getattr(self, "_grpc", None)) is not None:
            await server.stop(self._config.graceful_shutdown_timeout_s)
        if (inbox := getattr(self, "_inbox", None)) is not None:
            await inbox.close()
        shutdown_tracing()

    # -- HTTP (OpenAI-compatible) -------------------------------------------------------------------
    # /openapi.json documents the request and stream models too (cluster/serving/openapi_docs.py); done here,
    # in the class body, because @serve.ingress freezes a copy of http_app as soon as the class is defined.
    document(http_app)

    @http_app.post("/v1/completions", **COMPLETIONS_ROUTE)
    async def completions(self, request: Request) -> Response:
        return await self._http.generate(request, chat=False)

    @http_app.post("/v1/chat/completions", **CHAT_ROUTE)
    async def chat_completions(self, request: Request) -> Response:
        return await self._http.generate(request, chat=True)

    @http_app.get("/v1/models", **MODELS_ROUTE)
    async def models(self, request: Request) -> Response:
        return self._http.models(request)

    @http_app.get("/health", **HEALTH_ROUTE)
    async def health(self) -> JSONResponse:
        return await self._http.health()

    @http_app.get("/metrics", **METRICS_ROUTE)
    async def metrics(self, request: Request) -> Response:
        return await self._http.metrics(request)

    @http_app.get("/v1/stats", **STATS_ROUTE)
    async def stats(self, request: Request) -> Response:
        return await self._http.stats(request)

    @http_app.get(DOCS_PAGES[0], include_in_schema=False)
    async def docs(self, request: Request) -> Response:
        return self._http.docs_page(request, DOCS_PAGES[0])

    @http_app.get(DOCS_PAGES[1], include_in_schema=False)
    async def redoc(self, request: Request) -> Response:
        return self._http.docs_page(request, DOCS_PAGES[1])

IngressDeployment = serve.deployment(Ingress, name="Ingress")
