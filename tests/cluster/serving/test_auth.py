"""API keys (cluster/serving/auth.py) and TLS at the front doors, without Ray: the key sources and the
constant-time check; the OpenAI HTTP routes through FastAPI's TestClient and over a real TLS socket (uvicorn with
the ssl options Serve's proxy passes it, the openai SDK as the client); the gRPC service on its own grpc.aio
server on loopback, plaintext and TLS, through SpecServeClient. Every refusal: 401 / UNAUTHENTICATED, nothing
opened at the scheduler, one WARNING line without the key. The live cluster's run is test_auth_live.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.client import Credentials, SpecServeClient, collect
from cluster.serving.auth import ENV_API_KEYS, ApiKeys, AuthError, KeySources, bearer_token, parse_key_file
from cluster.serving.grpc_server import GrpcServer, read_tls_pair
from cluster.serving.grpc_service import SpecServeService
from cluster.serving.http_api import OpenAIFrontEnd
from cluster.serving.openapi_docs import DOCS_PAGES
from cluster.serving.rejections import RejectionLog
from cluster.serving.streams import until
from specserve_types.protocol import ServerDefaults
from tests.cluster.serving.test_grpc_service import CountingLogger, FakeStreams
from tests.cluster.serving.test_http_api import MODEL, ScriptedStreams
from tests.cluster.serving.tls_certs import TlsFiles, self_signed

KEY = "sk-test-0123456789abcdef"
NEXT_KEY = "sk-next-fedcba9876543210"  # a rotation: both accepted
WRONG = "sk-test-0123456789abcdeX"  # one character off


# -- the keys ----------------------------------------------------------------------------------------------
def test_key_file_lines_comments_and_env(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# rotated 2026-12\n{KEY}  # old\n\n  {NEXT_KEY}\n")
    assert parse_key_file(path.read_text()) == [KEY, NEXT_KEY]
    keys, mtime = KeySources(key_file=str(path)).load(environ={ENV_API_KEYS: "sk-env-key-0123456789, sk-env-2-0123456789"})
    assert keys == ("sk-env-key-0123456789", "sk-env-2-0123456789", KEY, NEXT_KEY) and mtime is not None
    assert KeySources().load(environ={})[0] == ()


def test_accepts_exactly_the_configured_keys() -> None:
    keys = ApiKeys.of(KEY, NEXT_KEY)
    assert keys.enabled and len(keys) == 2
    assert keys.accepts(KEY) and keys.accepts(NEXT_KEY)
    for presented in (None, "", WRONG, KEY[:-1], KEY + "x", KEY.upper(), "é" * 20):
        assert not keys.accepts(presented), presented
    assert ApiKeys.of().accepts(None) and not ApiKeys.of().enabled  # no key configured: open
    assert KEY not in repr(keys) and KEY not in repr(KeySources(keys=(KEY,)))


def test_bearer_header() -> None:
    assert bearer_token(f"Bearer {KEY}") == KEY and bearer_token(f"bearer  {KEY} ") == KEY
    assert bearer_token(None) is None and bearer_token(KEY) is None and bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None


def test_bad_key_configurations_fail_at_start_without_the_key(tmp_path: Path) -> None:
    with pytest.raises(AuthError, match="cannot read"):
        ApiKeys(KeySources(key_file=str(tmp_path / "absent")))
    (tmp_path / "empty").write_text("# nothing yet\n")
    with pytest.raises(AuthError, match="holds no key"):
        ApiKeys(KeySources(key_file=str(tmp_path / "empty")))
    with pytest.raises(AuthError, match="at least 16") as info:
        ApiKeys.of("short-key")
    assert "short-key" not in str(info.value)


def test_a_rotated_key_file_is_reread(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(KEY + "\n")
    keys = ApiKeys(KeySources(key_file=str(path), use_env=False))
    assert not keys.reload() and keys.accepts(KEY) and not keys.accepts(NEXT_KEY)
    path.write_text(f"{KEY}\n{NEXT_KEY}\n")
    os.utime(path, (time.time() + 5, time.time() + 5))
    assert keys.reload() and keys.accepts(NEXT_KEY)
    path.write_text("")  # a broken update keeps the keys in force
    os.utime(path, (time.time() + 10, time.time() + 10))
    with pytest.raises(AuthError):
        keys.reload()
    assert keys.accepts(KEY) and keys.accepts(NEXT_KEY)


# -- HTTP ----------------------------------------------------------------------------------------------------
class MetricStreams(ScriptedStreams):
    async def metrics_text(self) -> str:
        return "specserve_up 1\n"


def keyed_app(streams: ScriptedStreams, logger: logging.Logger, metrics_need_key: bool = False) -> FastAPI:
    """The ingress's HTTP routes (cluster/serving/ingress.py) with keys, over a scripted scheduler."""
    models = [{"id": MODEL, "role": "target", "draft": "ngram"}]
    front = OpenAIFrontEnd(streams, ServerDefaults(MODEL, "ngram"), lambda: models,  # type: ignore[arg-type]
                           RejectionLog(logger, window_s=0.0), retry_after_s=1, keys=ApiKeys.of(KEY, NEXT_KEY),
                           metrics_need_key=metrics_need_key)
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await front.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await front.generate(request, chat=True)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return front.models(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        return await front.health()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return await front.metrics(request)

    @app.get("/v1/stats")
    async def stats(request: Request) -> Response:
        return await front.stats(request)

    return app


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def log() -> Iterator[tuple[logging.Logger, Lines]]:
    logger = logging.getLogger("test.auth")
    handler = Lines()
    logger.addHandler(handler)
    try:
        yield logger, handler
    finally:
        logger.removeHandler(handler)


BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def assert_401(response: Any, missing: bool) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"].startswith("Bearer")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_api_key", None)
    assert error["message"].startswith("missing API key" if missing else "invalid API key")
    assert KEY not in response.text and WRONG not in response.text


def test_http_refuses_without_or_with_a_wrong_key(log: tuple[logging.Logger, Lines]) -> None:
    logger, lines = log
    streams = ScriptedStreams()
    with TestClient(keyed_app(streams, logger)) as client:
        assert_401(client.post("/v1/completions", json=BODY), missing=True)
        for header in (f"Bearer {WRONG}", KEY, f"Basic {KEY}", "Bearer"):
            assert_401(client.post("/v1/chat/completions", json={**BODY, "messages": [{"role": "user", "content": "x"}]},
                                   headers={"Authorization": header}), missing=False)
        for path in ("/v1/models", "/v1/stats"):
            assert_401(client.get(path, headers={"Authorization": f"Bearer {WRONG}"}), missing=False)
        assert streams.opened == []  # nothing reached the scheduler
        warnings = [r for r in lines.records if r.levelno == logging.WARNING]
        assert len(warnings) == 7 and len(lines.records) == 7  # one WARNING line per refusal
        for record in warnings:
            text = record.getMessage()
            assert "401" in text and "authorization" in text and "\n" not in text
            assert KEY not in text and WRONG not in text

        for key in (KEY, NEXT_KEY):
            answer = client.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
        assert len(streams.opened) == 2
        assert client.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).json()["data"][0]["id"] == MODEL


def test_http_health_and_metrics_stay_open_metrics_when_configured(log: tuple[logging.Logger, Lines]) -> None:
    logger, _ = log
    with TestClient(keyed_app(MetricStreams(), logger)) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200
    with TestClient(keyed_app(MetricStreams(), logger, metrics_need_key=True)) as client:
        assert client.get("/health").status_code == 200
        assert_401(client.get("/metrics"), missing=True)
        assert client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def docs_app(keys: ApiKeys, logger: logging.Logger) -> FastAPI:
    """The ingress's /docs and /redoc routes (FastAPI's own off) and its /openapi.json."""
    front = OpenAIFrontEnd(ScriptedStreams(), ServerDefaults(MODEL, "ngram"), list,  # type: ignore[arg-type]
                           RejectionLog(logger, window_s=0.0), retry_after_s=1, keys=keys)
    app = FastAPI(docs_url=None, redoc_url=None)

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> Response:
        return front.docs_page(request, "/docs")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> Response:
        return front.docs_page(request, "/redoc")

    return app


def test_the_docs_pages_ask_for_the_key_when_the_server_has_keys(log: tuple[logging.Logger, Lines]) -> None:
    """/docs and /redoc: 401 without a key when there are keys (a browser sends none: closed there), the page with
    one, open without keys; /openapi.json stays open (the schema is public)."""
    with TestClient(docs_app(ApiKeys.of(KEY), log[0])) as client:
        for path, marker in (("/docs", "swagger-ui"), ("/redoc", "redoc")):
            assert_401(client.get(path), missing=True)
            page = client.get(path, headers={"Authorization": f"Bearer {KEY}"})
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert marker in page.text and "/openapi.json" in page.text
        assert client.get("/openapi.json").status_code == 200
    with TestClient(docs_app(ApiKeys.of(), log[0])) as client:
        assert [client.get(path).status_code for path in DOCS_PAGES] == [200, 200]


def test_the_served_app_serves_its_own_docs_pages_not_fastapis() -> None:
    from cluster.serving.ingress import IngressDeployment

    init = IngressDeployment.func_or_class.__init__
    cells = dict(zip(init.__code__.co_freevars, (cell.cell_contents for cell in init.__closure__ or ()), strict=True))
    served = cells["frozen_app_or_func"]
    assert (served.docs_url, served.redoc_url) == (None, None)
    paths = {getattr(route, "path", None) for item in served.routes  # the class's routes: an included router
             for route in (item.original_router.routes if hasattr(item, "original_router") else [item])}
    assert set(DOCS_PAGES) <= paths and "/docs/oauth2-redirect" not in paths


class TlsServer:
    """uvicorn on 127.0.0.1 with the ssl options Serve's HTTP proxy passes it (ray/serve/_private/http_util.py),
    in a thread of this process; the clients reach it through the socket."""

    def __init__(self, app: FastAPI, tls: TlsFiles) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ssl_certfile=str(tls.cert),
                                ssl_keyfile=str(tls.key))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        (sock,) = self.server.servers[0].sockets
        return f"127.0.0.1:{sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_https_with_the_openai_sdk_and_a_plaintext_client_refused(tmp_path: Path,
                                                                 log: tuple[logging.Logger, Lines]) -> None:
    tls = self_signed(tmp_path)
    streams = ScriptedStreams()
    trust = ssl.create_default_context(cafile=str(tls.cert))
    with TlsServer(keyed_app(streams, log[0]), tls) as address:
        def sdk(api_key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"https://{address}/v1", api_key=api_key, max_retries=0, timeout=30,
                                 http_client=httpx.Client(verify=trust))

        completion = sdk(KEY).completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert completion.choices[0].finish_reason == "length"
        assert [m.id for m in sdk(NEXT_KEY).models.list()] == [MODEL]
        with pytest.raises(openai.AuthenticationError) as info:
            sdk(WRONG).completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        assert len(streams.opened) == 1
        with pytest.raises(httpx.RemoteProtocolError):  # plaintext HTTP to the TLS port: no answer
            httpx.get(f"http://{address}/health", timeout=10)
        with pytest.raises(httpx.ConnectError):  # TLS, but the test's certificate not trusted
            httpx.get(f"https://{address}/health", timeout=10)
        assert httpx.get(f"https://{address}/health", verify=trust, timeout=10).status_code == 200


# -- gRPC ----------------------------------------------------------------------------------------------------
def serve_keyed(streams: FakeStreams, tls: TlsFiles | None,
                test: Callable[[str, CountingLogger], Awaitable[None]]) -> None:
    async def main() -> None:
        log = CountingLogger()
        service = SpecServeService(streams, ServerDefaults("m", "ngram"),
                                   lambda: [{"id": "m", "role": "target", "draft": "ngram"}],
                                   RejectionLog(log, window_s=0.0), server_timeout_s=None, retry_after_s=3,
                                   keys=ApiKeys.of(KEY, NEXT_KEY))
        pair = read_tls_pair(str(tls.cert), str(tls.key)) if tls is not None else None
        server = GrpcServer(service, "127.0.0.1", 0, pair)
        await server.start()
        try:
            await until(test(f"127.0.0.1:{server.port}", log), asyncio.get_running_loop().time() + 60)
        finally:
            await server.stop(0.5)

    asyncio.run(main())


def call_status(credentials: Credentials, address: str, method: str = "generate") -> grpc.StatusCode | None:
    """The status a SpecServeClient call ends with (None: it worked)."""
    with SpecServeClient(address, timeout_s=20, credentials=credentials) as client:
        try:
            if method == "generate":
                (sample,) = collect(client.generate("x", max_tokens=3)).values()
                assert sample["finish_reason"] == "length"
            else:
                getattr(client, method)()
        except Exception as exc:
            return getattr(exc, "code", grpc.StatusCode.UNKNOWN)
    return None


def health_check(credentials: Credentials, address: str) -> int:
    """grpc.health.v1's answer, asked without a key."""
    channel = credentials.channel(address)
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    finally:
        channel.close()


@pytest.mark.parametrize("use_tls", [False, True], ids=["plaintext", "tls"])
def test_grpc_refuses_without_or_with_a_wrong_key(use_tls: bool, tmp_path: Path) -> None:
    tls = self_signed(tmp_path) if use_tls else None

    def creds(key: str | None) -> Credentials:
        return Credentials(key, tls=use_tls, ca_file=str(tls.cert) if tls else None)

    async def test(address: str, log: CountingLogger) -> None:
        status = lambda c, m="generate": asyncio.to_thread(call_status, c, address, m)  # noqa: E731
        unauthenticated = grpc.StatusCode.UNAUTHENTICATED
        assert await status(creds(None)) == unauthenticated
        assert await status(creds(WRONG)) == unauthenticated
        assert await status(creds(WRONG), "list_models") == unauthenticated
        assert await status(creds(None), "stats") == unauthenticated
        assert streams.opened == []  # refused before the message was parsed or the scheduler asked
        assert len(log.lines) == 4 and all("UNAUTHENTICATED" in line and "authorization" in line for line in log.lines)
        assert not any(KEY in line or WRONG in line for line in log.lines)
        assert await status(creds(KEY)) is None and await status(creds(NEXT_KEY)) is None
        assert await status(creds(KEY), "list_models") is None
        assert await status(creds(None), "health") is None  # SpecServe.Health: open, like the health service
        assert len(streams.opened) == 2

        assert await asyncio.to_thread(health_check, creds(None), address) == health_pb2.HealthCheckResponse.SERVING

    streams = FakeStreams(count=3)
    serve_keyed(streams, tls, test)


def test_grpc_tls_refuses_plaintext_and_untrusted_clients(tmp_path: Path) -> None:
    tls = self_signed(tmp_path / "server")
    other = self_signed(tmp_path / "other", common_name="someone-else")

    async def test(address: str, log: CountingLogger) -> None:
        status = lambda c: asyncio.to_thread(call_status, c, address)  # noqa: E731
        assert await status(Credentials(KEY)) == grpc.StatusCode.UNAVAILABLE  # plaintext: no handshake
        assert await status(Credentials(KEY, tls=True, ca_file=str(other.cert))) == grpc.StatusCode.UNAVAILABLE
        assert streams.opened == []
        assert await status(Credentials(KEY, tls=True, ca_file=str(tls.cert))) is None

    streams = FakeStreams(count=3)
    serve_keyed(streams, tls, test)


def test_client_credentials_from_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "client-key"
    key_file.write_text(f"# mine\n{KEY}\n{NEXT_KEY}\n")
    from_file = Credentials.from_env({"SPECSERVE_API_KEY_FILE": str(key_file), "SPECSERVE_TLS_CA_FILE": "/ca.pem"})
    assert (from_file.api_key, from_file.tls, from_file.ca_file) == (KEY, True, "/ca.pem")
    assert from_file.http_headers() == {"Authorization": f"Bearer {KEY}"} and from_file.scheme == "https"
    direct = Credentials.from_env({"SPECSERVE_API_KEY": NEXT_KEY, "SPECSERVE_TLS": "1"})
    assert (direct.api_key, direct.tls, direct.ca_file, direct.http_verify) == (NEXT_KEY, True, None, True)
    assert Credentials.from_env({}) == Credentials() and Credentials().grpc_metadata() == ()
    assert KEY not in repr(from_file)
