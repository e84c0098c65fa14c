"""The OpenAI HTTP front end without Ray: FastAPI's TestClient over the ingress's routes, wired to a scripted
scheduler (ScriptedStreams: the SchedulerStreams interface, chunks made up from the request).

What is checked: bounded bodies (413, 100,000-deep JSON -> 400 `body`), unpaired surrogates -> 400, refused
parameters -> 400 naming them, 429 with Retry-After, 500 / 503 without internals and with the request id,
include_usage, one WARNING line per refusal and no traceback, and /openapi.json describing the routes;
constrained decoding's fields reaching the scheduler and tool calls read back (whole, streamed, n > 1); then
schemathesis and the constraint fields' fuzzer run over the same app (the live cluster's run is
live_api/test_http_fuzz.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import schemathesis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.testclient import TestClient
from ray.exceptions import ActorUnavailableError

from cluster.engine.request_span import RequestSpan
from cluster.serving.http_api import OpenAIFrontEnd
from cluster.serving.json_body import MAX_BODY_BYTES
from cluster.serving.openai_api import parse_request
from cluster.serving.openai_models import REFUSED, REFUSED_COMPLETION
from cluster.serving.openapi_docs import (
    CHAT_ROUTE,
    COMPLETIONS_ROUTE,
    HEALTH_ROUTE,
    MODELS_ROUTE,
    STATS_ROUTE,
    document,
)
from cluster.serving.rejections import RejectionLog
from cluster.serving.streams import ChunkStream
from specserve_types.api import Constraint, RowLogprobs, TokenChunk
from specserve_types.protocol import GenerateArgs, IndexedChunk, ServerDefaults, StreamError
from tests.cluster.serving.live_api.fuzzing import fuzz_constraints, fuzz_schema

MODEL = "tiny"
CHAT = [{"role": "user", "content": "hi"}]


class ScriptedStream:
    """A scheduler stream (`__anext__`, `cancel`) over a list of items (chunks, or a StreamError as the last)."""

    def __init__(self, items: list[Any]) -> None:
        self._items = list(items)
        self.cancelled = False

    async def __anext__(self) -> Any:
        if self.cancelled or not self._items:
            raise StopAsyncIteration
        return self._items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


PROMPT_IDS = (7, 8, 9)  # the prompt the fake scheduler says it scored


def fake_rows(tokens: list[int], top: int) -> RowLogprobs:
    """Log-probabilities the fake verifier reports: each token's -1 / (1 + its position), alternatives below it."""
    values = np.array([-1.0 / (1 + i) for i in range(len(tokens))], np.float32)
    return RowLogprobs(values, np.array([[5000 + j for j in range(top)]] * len(tokens), np.int32).reshape(
        len(tokens), top), np.array([[v - 1 - j for j in range(top)] for v in values], np.float32).reshape(
        len(tokens), top), np.ones(len(tokens), np.int32))


def readable(item: IndexedChunk, args: GenerateArgs, first: bool) -> IndexedChunk:
    """The chunk with log-probabilities where the request asks for them, as the scheduler sends it (scheduler.py
    `_readable`): rows, the texts of the ids they name, and with echo the prompt on each completion's first chunk."""
    s, chunk = args.sampling, item.chunk
    rows = fake_rows(chunk.token_ids, s.logprobs) if s.logprobs is not None else None
    prompt = fake_rows(list(PROMPT_IDS[1:]), s.prompt_logprobs) if s.prompt_logprobs is not None and first else None
    if rows is None and prompt is None and not args.echo:
        return item
    ids = {*chunk.token_ids, *PROMPT_IDS, *(5000 + j for j in range(20))}
    pieces = {t: (f"w{t} ", tuple(f"w{t} ".encode())) for t in ids}
    echo = args.echo and first
    return dataclasses.replace(item, chunk=dataclasses.replace(chunk, logprobs=rows, prompt_logprobs=prompt),
                               pieces=pieces, prompt_token_ids=PROMPT_IDS if echo or prompt is not None else (),
                               prompt_text="w7 w8 w9 " if echo else None)


class ScriptedStreams:
    """SchedulerStreams' interface. Completion i of a request emits tokens 100 i, 100 i + 1, ... two per chunk,
    "w<token> " each, up to max_tokens; or, with `script`, completion i emits script[i] in chunks of 7 characters,
    a token each, ending with end of sequence. `refusal` is returned instead, `open_error` raised by open,
    `fail_after` (a chunk count) ends every stream with an internal StreamError carrying internals."""

    def __init__(self) -> None:
        self.opened: list[GenerateArgs] = []
        self.aborted: list[str] = []
        self.refusal: StreamError | None = None
        self.open_error: BaseException | None = None
        self.fail_after: int | None = None
        self.healthy = True
        self.script: list[str] | None = None

    def scripted(self, args: GenerateArgs) -> list[Any]:
        assert self.script is not None
        items: list[Any] = []
        for index in range(args.n):
            text = self.script[index % len(self.script)]
            pieces = [text[at:at + 7] for at in range(0, len(text), 7)] or [""]
            for at, piece in enumerate(pieces):
                last = at == len(pieces) - 1
                chunk = TokenChunk(args.request_id, [at], piece, finish_reason="eos" if last else None, offset=at,
                                   stats={"prompt_tokens": 5, "output_tokens": len(pieces)} if last else None)
                items.append(IndexedChunk(index, chunk, args.spec.contract))
        return items

    def items(self, args: GenerateArgs) -> list[Any]:
        seen: set[int] = set()
        out = []
        for item in self._items(args):
            if isinstance(item, IndexedChunk):
                item = readable(item, args, first=item.index not in seen)
                seen.add(item.index)
            out.append(item)
        return out

    def _items(self, args: GenerateArgs) -> list[Any]:
        if self.script is not None:
            return self.scripted(args)
        prompt_tokens = len(args.prompt_token_ids or ()) or len(args.prompt_text or "") or sum(
            len(content) for _, content in args.messages)
        items: list[Any] = []
        for index in range(args.n):
            tokens = [100 * index + j for j in range(args.sampling.max_tokens)]
            if not tokens:  # max_tokens 0 (echo): the prompt scored, one last chunk
                items.append(IndexedChunk(index, TokenChunk(args.request_id, [], "", finish_reason="length", stats={
                    "prompt_tokens": prompt_tokens, "output_tokens": 0}), args.spec.contract))
            for start in range(0, len(tokens), 2):
                part = tokens[start:start + 2]
                last = start + 2 >= len(tokens)
                chunk = TokenChunk(args.request_id, part, "".join(f"w{t} " for t in part), proposed=2, accepted=1,
                                   finish_reason="length" if last else None,
                                   stats={"prompt_tokens": prompt_tokens, "output_tokens": len(tokens)} if last
                                   else None)
                items.append(IndexedChunk(index, chunk, args.spec.contract))
        if self.fail_after is not None:
            items = [*items[:self.fail_after], StreamError("internal", "RuntimeError: CUDA error: secret internals")]
        return items

    async def open(self, args: GenerateArgs, timeout_s: float | None = None) -> tuple[StreamError | None, ChunkStream]:
        self.opened.append(args)
        if self.open_error is not None:
            raise self.open_error
        if self.refusal is not None:
            return self.refusal, ChunkStream()
        stream = ScriptedStream(self.items(args))
        first = await stream.__anext__()
        return None, ChunkStream(stream, first, abort=lambda: self.aborted.append(args.request_id))

    async def health(self) -> tuple[bool, str]:
        if self.open_error is not None:
            raise self.open_error
        return self.healthy, "ok" if self.healthy else "verifier down"

    async def stats(self) -> dict[str, Any]:
        if self.open_error is not None:
            raise self.open_error
        return {"engine": {"model": MODEL}, "scheduler": {"live": 0}}


def openai_app(streams: ScriptedStreams, logger: logging.Logger) -> FastAPI:
    """The ingress's HTTP routes (cluster/serving/ingress.py) over `streams`, without Serve."""
    models = [{"id": MODEL, "role": "target", "draft": "ngram"}]
    front = OpenAIFrontEnd(streams, ServerDefaults(MODEL, "ngram"), lambda: models,  # type: ignore[arg-type]
                           RejectionLog(logger, window_s=0.0), retry_after_s=3)
    app = FastAPI(title="specserve")

    @app.post("/v1/completions", **COMPLETIONS_ROUTE)
    async def completions(request: Request) -> Response:
        return await front.generate(request, chat=False)

    @app.post("/v1/chat/completions", **CHAT_ROUTE)
    async def chat_completions(request: Request) -> Response:
        return await front.generate(request, chat=True)

    @app.get("/v1/models", **MODELS_ROUTE)
    async def list_models(request: Request) -> Response:
        return front.models(request)

    @app.get("/health", **HEALTH_ROUTE)
    async def health() -> JSONResponse:
        return await front.health()

    @app.get("/v1/stats", **STATS_ROUTE)
    async def stats(request: Request) -> Response:
        return await front.stats(request)

    document(app)
    return app


LOGGER = logging.getLogger("test.http_api")


@pytest.fixture
def streams() -> ScriptedStreams:
    return ScriptedStreams()


@pytest.fixture
def client(streams: ScriptedStreams) -> Iterator[TestClient]:
    with TestClient(openai_app(streams, LOGGER), raise_server_exceptions=False) as test_client:
        yield test_client


def post(client: TestClient, path: str, data: bytes | str, **headers: str) -> Any:
    return client.post(path, content=data, headers={"Content-Type": "application/json", **headers})


def assert_error(response: Any, status: int, param: str | None, kind: str = "invalid_request_error") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == kind
    assert error["param"] == param
    if param is not None:
        assert error["message"].startswith(f"{param}: ")
    return error


# -- bodies ------------------------------------------------------------------------------------------------
def test_a_100000_deep_body_is_400_naming_the_body(client: TestClient, streams: ScriptedStreams) -> None:
    for deep in ("[" * 100_000 + "]" * 100_000, '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
                 '{"prompt": "x", "user": ' + "[" * 40 + "]" * 40 + "}"):
        assert_error(post(client, "/v1/completions", deep), 400, "body")
    assert streams.opened == []


def test_a_body_over_the_limit_is_413(client: TestClient, streams: ScriptedStreams) -> None:
    prompt = "x" * (MAX_BODY_BYTES - 40)
    body = json.dumps({"prompt": prompt, "max_tokens": 2, "user": "u" * 64})
    assert len(body) > MAX_BODY_BYTES
    error = assert_error(post(client, "/v1/completions", body), 413, "body")
    assert str(MAX_BODY_BYTES) in error["message"]
    assert streams.opened == []


@pytest.mark.parametrize("data", [b"{not json", b"", b"\xff\xfe{}", b'{"prompt": "x", "temperature": NaN}',
                                  b'{"prompt": "x", "top_p": Infinity}', b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}",
                                  b"[1, 2]", b'"prompt"', b"null"])
def test_bodies_that_are_not_a_json_object_are_400(client: TestClient, data: bytes) -> None:
    assert_error(post(client, "/v1/completions", data), 400, "body")


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", r'{"prompt": "abc\ud800def", "max_tokens": 4}', "prompt"),
        ("/v1/completions", r'{"prompt": ["abc\udfffdef"], "max_tokens": 4}', "prompt"),
        ("/v1/completions", r'{"prompt": "abc", "stop": ["\ud800"], "max_tokens": 4}', "stop"),
        ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 4}',
         "messages[0].content"),
        ("/v1/chat/completions",
         r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}], "max_tokens": 4}',
         "messages[0].content"),
        ("/v1/completions", r'{"prompt": "abc", "model": "m\ud800"}', "model"),
    ],
)
def test_unpaired_surrogates_are_400_naming_the_field(client: TestClient, streams: ScriptedStreams, path: str,
                                                      raw: str, param: str) -> None:
    assert_error(post(client, path, raw), 400, param)
    assert streams.opened == []


# -- parameters --------------------------------------------------------------------------------------------
REFUSED_VALUES: dict[str, Any] = {
    "best_of": 2, "echo": True, "suffix": "}", "logprobs": 1, "top_logprobs": 2,
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
    "functions": [{"name": "f"}], "function_call": "auto", "guided_whitespace_pattern": r"[ \n]*",
    "audio": {"voice": "alloy"}, "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
}


@pytest.mark.parametrize("name", sorted(REFUSED_COMPLETION))
def test_refused_parameters_are_400_naming_them(client: TestClient, streams: ScriptedStreams, name: str) -> None:
    error = assert_error(client.post("/v1/completions", json={"prompt": "x", name: REFUSED_VALUES[name]}), 400, name)
    assert error["message"] == f"{name}: {REFUSED_COMPLETION[name]}"
    if name in REFUSED:
        chat_value = True if name == "logprobs" else REFUSED_VALUES[name]  # chat's logprobs is a boolean
        assert_error(client.post("/v1/chat/completions", json={"messages": CHAT, name: chat_value}), 400, name)
    assert streams.opened == []


def test_refused_parameters_pass_with_the_value_that_changes_nothing(client: TestClient,
                                                                     streams: ScriptedStreams) -> None:
    harmless = {"best_of": 1, "echo": False, "suffix": "", "logit_bias": {}, "tools": [], "tool_choice": "none",
                "functions": [], "function_call": "none", "response_format": {"type": "text"}, "audio": None,
                "modalities": ["text"], "prediction": None, "top_logprobs": 0, "parallel_tool_calls": True,
                "user": "someone", "metadata": {"a": "b"}}
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **harmless}
                       ).status_code == 200
    assert client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "logprobs": False,
                                                     **harmless}).status_code == 200
    assert len(streams.opened) == 2


def test_constraint_fields_reach_the_scheduler(client: TestClient, streams: ScriptedStreams) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    bodies = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
               Constraint("json", json.dumps(schema), "response_format")),
              ({"response_format": {"type": "json_object"}}, Constraint("json", '{"type": "object"}', "response_format")),
              ({"structured_outputs": {"regex": "[ab]+"}}, Constraint("regex", "[ab]+", "structured_outputs.regex")),
              ({"guided_choice": ["yes", "no"]}, Constraint("choice", '["yes", "no"]', "guided_choice")),
              ({"guided_grammar": 'start: "x"'}, Constraint("grammar", 'start: "x"', "guided_grammar"))]
    for body, constraint in bodies:
        for path, base in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "x"})):
            assert client.post(path, json={**base, "max_tokens": 2, **body}).status_code == 200
            assert streams.opened[-1].constraint == constraint
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logit_bias": {"7": -100, "3": 2}}
                       ).status_code == 200
    assert streams.opened[-1].sampling.logit_bias == ((3, 2.0), (7, -100.0))


def test_the_engine_refusing_a_constraint_is_400_naming_its_field(client: TestClient, streams: ScriptedStreams) -> None:
    """The engine compiles the constraint at submit; its InvalidRequestError comes back as the scheduler's refusal."""
    streams.refusal = StreamError("invalid", "does not compile: unknown name: \"b\"", "guided_grammar")
    for stream in (False, True):
        error = assert_error(client.post("/v1/chat/completions", json={
            "messages": CHAT, "guided_grammar": 'start: "a" b', "stream": stream}), 400, "guided_grammar")
        assert "does not compile" in error["message"]


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_calls_whole_streamed_and_n2(client: TestClient, streams: ScriptedStreams) -> None:
    streams.script = [f"{CALL_TEXT}\n{CALL_TEXT.replace('Paris', 'Oslo')}", "No tool needed."]
    body = {"messages": CHAT, "tools": [WEATHER_TOOL], "tool_choice": "auto", "n": 2}
    whole = client.post("/v1/chat/completions", json=body).json()
    assert streams.opened[-1].tools and streams.opened[-1].constraint is None
    called, text = whole["choices"]
    assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"])["city"] for c in called["message"]["tool_calls"]] == ["Paris",
                                                                                                          "Oslo"]
    assert text["finish_reason"] == "stop" and text["message"] == {"role": "assistant", "content": "No tool needed."}
    events = sse_payloads(client.post("/v1/chat/completions", json={**body, "stream": True}))
    calls: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    content = {0: "", 1: ""}
    for event in events:
        (choice,) = event["choices"]
        delta = choice["delta"]
        content[choice["index"]] += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                calls[choice["index"]].append({**call["function"]})
            else:
                calls[choice["index"]][call["index"]]["arguments"] += call["function"]["arguments"]
    assert content == {0: "", 1: "No tool needed."}
    assert [c["name"] for c in calls[0]] == ["get_weather"] * 2 and calls[1] == []
    assert [json.loads(c["arguments"]) for c in calls[0]] == [{"city": "Paris"}, {"city": "Oslo"}]
    finishes = {event["choices"][0]["index"]: event["choices"][0]["finish_reason"] for event in events
                if event["choices"][0]["finish_reason"]}
    assert finishes == {0: "tool_calls", 1: "stop"}
    required = client.post("/v1/chat/completions", json={**body, "tool_choice": "required", "n": 1}).json()
    assert streams.opened[-1].constraint is not None and streams.opened[-1].constraint.field == "tools"
    assert required["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),  # strict: no coercion
        ({"prompt": "x", "n": True}, "n"),
        ({"prompt": "x", "n": 2.5}, "n"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "temperature": 10**400}, "temperature"),  # beyond a float
        ({"prompt": "x", "seed": 1 << 63}, "seed"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [[1], [2]]}, "prompt"),
        ({"prompt": "x", "k": "many"}, "k"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"prompt": "x", "model": "gpt-4o"}, "model"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_bad_parameters_are_400_naming_them(client: TestClient, streams: ScriptedStreams, body: dict,
                                            param: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    assert_error(client.post(path, json=body), 400, param)
    assert streams.opened == []


# -- answers -----------------------------------------------------------------------------------------------
def sse_payloads(response: Any) -> list[Any]:
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_completion_and_its_stream(client: TestClient, streams: ScriptedStreams) -> None:
    response = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "n": 2})
    body = response.json()
    assert response.headers["x-specserve-request-id"] == body["id"] == streams.opened[0].request_id
    assert [c["text"] for c in body["choices"]] == ["w0 w1 w2 ", "w100 w101 w102 "]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    chunks = sse_payloads(client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "w0 w1 w2 "
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("chat", [False, True])
def test_include_usage_ends_the_stream_with_the_usage(client: TestClient, chat: bool) -> None:
    body: dict[str, Any] = {"messages": CHAT} if chat else {"prompt": "abcd"}
    body |= {"max_tokens": 5, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_payloads(client.post("/v1/chat/completions" if chat else "/v1/completions", json=body))
    *content, last = chunks
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 2 if chat else 4, "completion_tokens": 10,
                                                       "total_tokens": 12 if chat else 14}
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in content)
    assert last["object"] == ("chat.completion.chunk" if chat else "text_completion")
    if chat:
        first_of = {c["choices"][0]["index"]: c["choices"][0]["delta"] for c in reversed(content)}
        assert all(delta["role"] == "assistant" for delta in first_of.values())


def test_a_full_server_is_429_with_retry_after(client: TestClient, streams: ScriptedStreams) -> None:
    streams.refusal = StreamError("capacity", "queue full (100 requests)")
    for stream in (False, True):
        response = client.post("/v1/completions", json={"prompt": "x", "stream": stream})
        error = assert_error(response, 429, None, kind="capacity_error")
        assert response.headers["Retry-After"] == "3" and error["message"] == "queue full (100 requests)"


def test_a_refusal_by_the_scheduler_names_its_field(client: TestClient, streams: ScriptedStreams) -> None:
    streams.refusal = StreamError("invalid", "longer than the context (300 > 256 tokens)", "prompt")
    assert_error(client.post("/v1/completions", json={"prompt": "x"}), 400, "prompt")


def test_a_server_fault_is_500_with_the_request_id_only(client: TestClient, streams: ScriptedStreams,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    streams.open_error = KeyError("secret internals")
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        response = client.post("/v1/completions", json={"prompt": "x"})
    error = assert_error(response, 500, None, kind="internal_error")
    request_id = response.headers["x-specserve-request-id"]
    assert error["message"] == f"internal server error (request id {request_id})" and "secret" not in response.text
    (record,) = [r for r in caplog.records if r.name == "ray.serve"]
    assert request_id in record.getMessage() and record.exc_info is not None  # the traceback, once, in the log

    streams.open_error = None
    streams.fail_after = 3  # the scheduler reports an internal error mid-way
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20})
    assert_error(response, 500, None, kind="internal_error")
    assert "secret" not in response.text and streams.aborted == []  # it ended: nothing left to abort
    *_, failed = sse_payloads(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True}))
    assert failed["error"]["type"] == "internal_error" and "secret" not in json.dumps(failed)


def test_a_scheduler_gone_is_503(client: TestClient, streams: ScriptedStreams) -> None:
    streams.open_error = ActorUnavailableError("scheduler replica at 10.0.0.1 is gone", None)
    response = client.post("/v1/completions", json={"prompt": "x"})
    assert_error(response, 503, None, kind="unavailable_error")
    assert "10.0.0.1" not in response.text and response.headers["Retry-After"] == "3"
    assert client.get("/health").status_code == 503
    assert_error(client.get("/v1/stats"), 503, None, kind="unavailable_error")


def test_models_health_and_stats(client: TestClient, streams: ScriptedStreams) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert client.get("/health").json() == {"status": "ok"}
    streams.healthy = False
    response = client.get("/health")
    assert response.status_code == 503 and response.json() == {"status": "verifier down"}
    assert client.get("/v1/stats").json()["engine"]["model"] == MODEL


def test_a_client_leaving_a_stream_aborts_the_request(streams: ScriptedStreams) -> None:
    """The SSE generator closed after one event (what Starlette does when the client disconnects)."""
    front = OpenAIFrontEnd(streams, ServerDefaults(MODEL), lambda: [], RejectionLog(LOGGER),  # type: ignore[arg-type]
                           retry_after_s=1)

    async def leave_after_one_event() -> None:
        parsed = parse_request({"prompt": "x", "max_tokens": 50, "stream": True}, ServerDefaults(MODEL), chat=False)
        _, chunks = await streams.open(parsed.args)
        events = front._sse(parsed, chunks, chat=False, span=RequestSpan(None))
        assert (await events.__anext__()).startswith("data: {")
        await events.aclose()

    asyncio.run(leave_after_one_event())
    assert streams.aborted == [streams.opened[0].request_id]


def test_a_client_leaving_while_sending_the_body(streams: ScriptedStreams, caplog: pytest.LogCaptureFixture) -> None:
    front = OpenAIFrontEnd(streams, ServerDefaults(MODEL), lambda: [], RejectionLog(LOGGER),  # type: ignore[arg-type]
                           retry_after_s=1)
    messages = [{"type": "http.request", "body": b'{"prompt": "ab', "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)
    with caplog.at_level(logging.WARNING):
        response = asyncio.run(front.generate(request, chat=False))
    assert response.status_code == 400 and streams.opened == []
    assert [r.exc_info for r in caplog.records] == [None]


# -- logs --------------------------------------------------------------------------------------------------
def test_a_refused_request_is_one_warning_line_without_traceback(client: TestClient,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        client.post("/v1/completions", json={"prompt": "x", "top_p": 7})
        post(client, "/v1/completions", "[" * 100_000)
        client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [{"type": "function"}]})
    records = [r for r in caplog.records if r.name == LOGGER.name]
    assert [r.levelno for r in records] == [logging.WARNING] * 3
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in records)
    for record, field in zip(records, ("top_p", "body", "tools"), strict=True):
        assert "field=" in record.getMessage() and field in record.getMessage().split("field=")[1]
    assert not [r for r in caplog.records if r.exc_info is not None]


# -- the published schema ----------------------------------------------------------------------------------
def test_openapi_documents_the_routes(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    schemas = schema["components"]["schemas"]
    for path, request in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        operation = schema["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{request}"}
        assert set(operation["responses"]) == {"200", "400", "401", "413", "429", "500", "503"}
        assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "Retry-After" in operation["responses"]["429"]["headers"]
    completion = schemas["CompletionRequest"]
    assert completion["required"] == ["prompt"] and completion["additionalProperties"] is True
    properties = completion["properties"]
    for name in ("top_k", "min_p", "repetition_penalty", "ignore_eos", "contract", "k", "draft", "stream_options",
                 *REFUSED):
        assert name in properties or name in schemas["ChatCompletionRequest"]["properties"], name
    assert {"maximum": 8192, "minimum": 0, "type": "integer"} in properties["max_tokens"]["anyOf"]  # 0: echo
    references = {value for value in _walk(schema) if isinstance(value, str) and value.startswith("#/components/")}
    assert {ref.rsplit("/", 1)[1] for ref in references} <= set(schemas)


def _walk(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item)
    else:
        yield value


def test_schemathesis_over_the_app(streams: ScriptedStreams) -> None:
    """The live run (live_api/test_http_fuzz.py) in miniature: positive and negative data, no Ray."""
    app = openai_app(streams, LOGGER)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    counts = fuzz_schema(schema, max_examples=25)
    assert counts["POST /v1/completions"]["negative"] > 0 and counts["POST /v1/chat/completions"]["positive"] > 0


def test_the_constraint_fields_fuzzed(client: TestClient, streams: ScriptedStreams) -> None:
    """Every request carries constraint fields, right or wrong: a 200 matching its model or a 400 naming a field."""
    streams.script = ['<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', "plain", "<tool_c"]
    seen = fuzz_constraints(lambda path, body: client.post(path, json=body), max_examples=200)
    assert seen.get("200", 0) > 20 and seen.get("400", 0) > 20, seen


def test_the_served_app_publishes_the_request_models() -> None:
    """Serve answers with the copy of http_app that @serve.ingress froze when Ingress was defined: that copy's
    /openapi.json must hold the request and stream models (document() has to run before the freeze)."""
    from cluster.serving.ingress import IngressDeployment

    init = IngressDeployment.func_or_class.__init__
    cells = dict(zip(init.__code__.co_freevars, (cell.cell_contents for cell in init.__closure__ or ()), strict=True))
    served = cells["frozen_app_or_func"]
    schemas = served.openapi()["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "CompletionChunk", "ChatCompletionChunk"} <= set(schemas)
    assert set(served.openapi()["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                              "/v1/stats", "/metrics"}
