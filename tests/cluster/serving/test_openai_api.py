"""OpenAI bodies without a server: bounded JSON (json_body), parsing through the published models
(openai_models, openai_api.parse_request), and the formatted answers checked against the response models."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cluster.serving.json_body import BodyError, depth, parse_json, read_body
from cluster.serving.openai_api import Collected, completion_body, parse_request, sse_event, usage_event
from cluster.serving.openai_models import (
    REFUSED,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
)
from specserve_types.api import InvalidRequestError, TokenChunk
from specserve_types.protocol import IndexedChunk, ServerDefaults

DEFAULTS = ServerDefaults("tiny", "ngram")
CHAT = [{"role": "user", "content": "hi"}]


# -- bounded JSON ------------------------------------------------------------------------------------------
def test_depth() -> None:
    assert [depth(v) for v in (3, "x", [], {}, [[]], {"a": [1, {"b": []}]}, [[1], [[2]], 3])] == [0, 0, 1, 1, 2, 4, 3]


@pytest.mark.parametrize("data", [b"[" * 100_000 + b"]" * 100_000, b"[" * 33 + b"]" * 33,
                                  b'{"a": ' + b'{"a": ' * 40 + b"1" + b"}" * 41])
def test_deep_json_is_refused(data: bytes) -> None:
    with pytest.raises(BodyError) as info:
        parse_json(data)
    assert info.value.status == 400 and "nested deeper than 32" in info.value.message


def test_json_at_the_depth_limit_parses() -> None:
    assert depth(parse_json(b"[" * 32 + b"]" * 32)) == 32


@pytest.mark.parametrize("data", [b"NaN", b'{"t": -Infinity}', b"{'a': 1}", b"\x80", b"1" * 5000, b""])
def test_what_json_does_not_allow_is_refused(data: bytes) -> None:
    with pytest.raises(BodyError) as info:
        parse_json(data)
    assert info.value.status == 400 and info.value.message.startswith("not valid JSON")


def test_utf16_json_parses() -> None:
    assert parse_json('{"prompt": "é"}'.encode("utf-16")) == {"prompt": "é"}


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def test_read_body_stops_at_the_limit() -> None:
    assert asyncio.run(read_body({}, _chunks(b"ab", b"cd"), limit=4)) == b"abcd"
    with pytest.raises(BodyError) as info:
        asyncio.run(read_body({}, _chunks(b"ab", b"cd", b"e"), limit=4))
    assert info.value.status == 413
    with pytest.raises(BodyError) as declared:  # refused by its Content-Length, before reading
        asyncio.run(read_body({"content-length": "5"}, _chunks(), limit=4))
    assert declared.value.status == 413 and "(5)" in declared.value.message


# -- parsing -----------------------------------------------------------------------------------------------
def test_every_parameter_reaches_the_request() -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 7, "n": 3, "stop": ["a", "b"], "seed": -5,
            "temperature": 0.5, "top_p": 0.9, "presence_penalty": 0.1, "frequency_penalty": -0.2, "top_k": 40,
            "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "contract": "typical", "k": 3,
            "draft": "none", "stream": True, "stream_options": {"include_usage": True}}
    parsed = parse_request(body, DEFAULTS, chat=False)
    sampling, spec = parsed.args.sampling, parsed.args.spec
    assert (sampling.max_tokens, sampling.stop, sampling.seed, sampling.temperature, sampling.top_p) == (
        7, ("a", "b"), -5, 0.5, 0.9)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.top_k, sampling.min_p) == (
        0.1, -0.2, 40, 0.05)
    assert sampling.repetition_penalty == 1.1 and sampling.ignore_eos
    assert (spec.contract, spec.k, spec.draft, parsed.args.n) == ("typical", 3, "none", 3)
    assert parsed.stream and parsed.include_usage and parsed.args.prompt_text == "x"


def test_null_means_unset() -> None:
    names = set(CompletionRequest.model_fields) - {"prompt"}
    parsed = parse_request({"prompt": "x", **dict.fromkeys(names)}, DEFAULTS, chat=False)
    default = parse_request({"prompt": "x"}, DEFAULTS, chat=False)
    assert parsed.args.sampling == default.args.sampling and parsed.args.spec == default.args.spec
    assert default.args.spec == default.args.spec.__class__(contract="greedy", k=None, draft="ngram")
    assert not parsed.stream and not parsed.include_usage and parsed.args.n == 1


def test_prompt_forms_and_integral_numbers() -> None:
    assert parse_request({"prompt": [[4, 5]]}, DEFAULTS, chat=False).args.prompt_token_ids == (4, 5)
    assert parse_request({"prompt": ["hello"]}, DEFAULTS, chat=False).args.prompt_text == "hello"
    parsed = parse_request({"prompt": [4.0, 5], "max_tokens": 3.0, "k": 2.0}, DEFAULTS, chat=False)
    assert parsed.args.prompt_token_ids == (4, 5) and parsed.args.sampling.max_tokens == 3 and parsed.args.spec.k == 2
    assert parse_request({"prompt": "x", "k": "auto", "temperature": 1}, DEFAULTS, chat=False).args.spec.contract == "exact"


def test_chat_parts_roles_and_max_completion_tokens() -> None:
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                          "name": "ann"}],
            "max_tokens": 9, "max_completion_tokens": 4}
    args = parse_request(body, DEFAULTS, chat=True).args
    assert args.chat and args.messages == (("system", "be brief"), ("user", "ab")) and args.sampling.max_tokens == 4


def error_of(body: Any, chat: bool = False) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(body, DEFAULTS, chat=chat)
    return info.value


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "must be >= 1, got 0"),
        ({"prompt": "x", "top_p": 0}, "top_p", "must be > 0, got 0"),
        ({"prompt": "x", "n": "2"}, "n", "must be an integer, got '2'"),
        ({"prompt": "x", "ignore_eos": 1}, "ignore_eos", "must be a boolean, got 1"),
        ({"prompt": "x", "contract": "fast"}, "contract", "must be 'exact', 'greedy' or 'typical', got 'fast'"),
        ({"prompt": "x", "k": 9}, "k", 'must be an integer in [0, 8] or "auto"'),
        ({"prompt": [1, -2]}, "prompt", "must be a non-empty string, a non-empty list of token ids (>= 0), "
                                        "or a batch of one of these"),
        ({"prompt": "x", "stop": "", }, "stop", "must be a non-empty string or a list of non-empty strings"),
        ({}, "prompt", "is required"),
        ([], "body", "must be a JSON object"),
        ({"prompt": "x", "model": "m" * 129}, "model", "must be at most 128 characters"),
        ({"prompt": "x", "stream": False, "stream_options": {}}, "stream_options", "is only allowed with stream: true"),
        ({"prompt": "x", "temperature": "\ud800"}, "temperature", "must be a number, got '\\ud800'"),
    ],
)
def test_errors_name_the_parameter_as_sent(body: Any, field: str, message: str) -> None:
    error = error_of(body)
    assert (error.field, error.message) == (field, message)


def test_chat_errors_name_the_message() -> None:  # (a completion's `prompt` in a chat body is an unknown field)
    assert error_of({"messages": []}, chat=True).field == "messages"
    assert error_of({"messages": [CHAT[0], {"role": "user", "content": ""}]}, chat=True).field == "messages[1].content"
    assert error_of({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                    chat=True).field == "messages[0].content"
    assert parse_request({"messages": CHAT, "prompt": 5}, DEFAULTS, chat=True).args.messages == (("user", "hi"),)


def test_quoted_values_are_short_and_escaped() -> None:
    error = error_of({"prompt": "x", "temperature": "é" * 1000})
    assert error.message.isascii() and len(error.message) < 120


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_parameters_say_so(name: str) -> None:
    value: Any = {"best_of": 3, "echo": True, "suffix": "x", "logprobs": 2, "top_logprobs": 1, "logit_bias": {"1": 1},
                  "tools": [{}], "tool_choice": "required", "functions": [{}], "function_call": {"name": "f"},
                  "response_format": {"type": "json_schema"}, "audio": {}, "modalities": ["audio"],
                  "prediction": {}, "web_search_options": {}}[name]
    error = error_of({"prompt": "x", name: value})
    assert (error.field, error.message) == (name, REFUSED[name]) and "not supported" in error.message


def test_the_models_cover_the_parameters_of_both_routes() -> None:
    shared = set(CompletionRequest.model_fields) & set(ChatCompletionRequest.model_fields)
    assert set(REFUSED) <= set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert {"top_k", "min_p", "repetition_penalty", "ignore_eos", "contract", "k", "draft", "stream_options",
            "n", "stop", "seed", "max_tokens", "temperature", "top_p", "logprobs"} <= shared
    for model in (CompletionRequest, ChatCompletionRequest):
        assert model.model_json_schema()["additionalProperties"] is True


# -- formatting --------------------------------------------------------------------------------------------
def collected() -> Collected:
    result = Collected(n=2)
    for index in (1, 0):
        result.add(IndexedChunk(index, TokenChunk("r", [1, 2], "ab", proposed=3, accepted=1), "greedy"))
        result.add(IndexedChunk(index, TokenChunk("r", [3], "c", finish_reason="eos", stats={"prompt_tokens": 4}),
                                "greedy"))
    return result


def test_answers_match_the_published_models() -> None:
    done = collected()
    completion = CompletionResponse.model_validate(completion_body("r", "m", done, chat=False))
    assert completion.usage.completion_tokens == 6 and completion.choices[0].finish_reason == "stop"
    chat = ChatCompletionResponse.model_validate(completion_body("r", "m", done, chat=True))
    assert chat.choices[1].message.content == "abc"
    for chat_mode, model in ((False, CompletionChunk), (True, ChatCompletionChunk)):
        item = IndexedChunk(0, TokenChunk("r", [3], "c", finish_reason="length", stats={"x": 1}), "exact")
        event = sse_event("r", "m", item, chat_mode, first=True, include_usage=True)
        chunk = model.model_validate(json.loads(event.removeprefix("data: ")))
        assert chunk.usage is None and chunk.choices[0].finish_reason == "length"
        assert chunk.specserve is not None and chunk.specserve.stats == {"x": 1}
        last = model.model_validate(json.loads(usage_event("r", "m", done, chat_mode).removeprefix("data: ")))
        assert last.choices == [] and last.usage is not None and last.usage.total_tokens == 10
    plain = json.loads(sse_event("r", "m", item, chat=False, first=False).removeprefix("data: "))
    assert "usage" not in plain
