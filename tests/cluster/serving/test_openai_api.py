"""OpenAI bodies without a server: bounded JSON (json_body), parsing through the published models
(openai_models, openai_api.parse_request), and the formatted answers checked against the response models."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel

from cluster.serving.json_body import BodyError, depth, parse_json, read_body
from cluster.serving.openai_api import (
    Collected,
    SSEWriter,
    ToolOutput,
    completion_body,
    parse_request,
    sse_event,
    usage_event,
)
from cluster.serving.openai_models import (
    REFUSED,
    REFUSED_COMPLETION,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
)
from cluster.serving.tool_calls import tool_call_grammar
from specserve_types.api import Constraint, InvalidRequestError, TokenChunk
from specserve_types.protocol import JSON_OBJECT_SCHEMA, IndexedChunk, ServerDefaults

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
    """Every field but completions' max_tokens, whose absence is OpenAI's and vLLM's 16 and whose null is vLLM's
    "until the model ends" (test_max_tokens_defaults_are_openais_and_vllms)."""
    names = set(CompletionRequest.model_fields) - {"prompt", "max_tokens"}
    parsed = parse_request({"prompt": "x", **dict.fromkeys(names)}, DEFAULTS, chat=False)
    default = parse_request({"prompt": "x"}, DEFAULTS, chat=False)
    assert parsed.args.sampling == default.args.sampling and parsed.args.spec == default.args.spec
    assert default.args.spec == default.args.spec.__class__(contract="greedy", k=None, draft="ngram")
    assert not parsed.stream and not parsed.include_usage and parsed.args.n == 1


def test_max_tokens_defaults_are_openais_and_vllms() -> None:
    """A chat without max_tokens (or max_completion_tokens) generates until the model ends the answer (None: the
    context's room, resolved once the prompt is tokenized); a completion without it 16 tokens, with null as a chat."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_request(chat, DEFAULTS, chat=True).args.sampling.max_tokens is None
    assert parse_request({**chat, "max_tokens": None, "max_completion_tokens": None}, DEFAULTS,
                         chat=True).args.sampling.max_tokens is None
    assert parse_request({**chat, "max_completion_tokens": 5}, DEFAULTS, chat=True).args.sampling.max_tokens == 5
    assert parse_request({"prompt": "x"}, DEFAULTS, chat=False).args.sampling.max_tokens == 16
    assert parse_request({"prompt": "x", "max_tokens": None}, DEFAULTS, chat=False).args.sampling.max_tokens is None


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
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "must be at least 1 (0 only with echo: the prompt scored, "
                                                     "nothing generated)"),
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


@pytest.mark.parametrize("name", sorted(REFUSED_COMPLETION))
def test_refused_parameters_say_so(name: str) -> None:
    value: Any = {"best_of": 3, "echo": True, "suffix": "x", "logprobs": 2, "top_logprobs": 1,
                  "tools": [{}], "tool_choice": "required", "functions": [{}], "function_call": {"name": "f"},
                  "audio": {}, "modalities": ["audio"], "prediction": {}, "web_search_options": {},
                  "guided_whitespace_pattern": " *"}[name]
    error = error_of({"prompt": "x", name: value})
    assert (error.field, error.message) == (name, REFUSED_COMPLETION[name]) and "supported" in error.message
    assert name not in REFUSED or "not supported" in error.message


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


# -- constrained decoding: what each field becomes -------------------------------------------------------
class Step(BaseModel):
    explanation: str
    output: str


class Answer(BaseModel):
    steps: list[Step]
    final_answer: str


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]


def constraint_of(body: dict[str, Any], chat: bool = True) -> Constraint | None:
    return parse_request({"messages": CHAT, **body} if chat else {"prompt": "x", **body}, DEFAULTS, chat=chat
                         ).args.constraint


def test_response_format() -> None:
    assert constraint_of({"response_format": {"type": "text"}}) is None
    assert constraint_of({"response_format": {"type": "json_object"}}) == Constraint("json", JSON_OBJECT_SCHEMA,
                                                                                     "response_format")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"type": "json_schema", "json_schema": {"name": "A-b_1", "schema": schema, "strict": True,
                                                   "description": "an a"}}
    constraint = constraint_of({"response_format": body})
    assert constraint is not None and (constraint.kind, json.loads(constraint.value), constraint.field) == (
        "json", schema, "response_format")
    no_schema = constraint_of({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}})
    assert no_schema is not None and no_schema.value == "{}"  # any JSON value
    assert constraint_of({"response_format": {"type": "json_object"}}, chat=False) is not None  # completions too


def test_what_the_openai_sdk_sends_for_a_pydantic_model() -> None:
    """`client.chat.completions.parse(..., response_format=Answer)` sends this body's response_format."""
    from openai.lib._parsing._completions import type_to_response_format_param

    response_format = type_to_response_format_param(Answer)
    constraint = constraint_of({"response_format": response_format})
    assert constraint is not None and constraint.kind == "json"
    assert json.loads(constraint.value) == response_format["json_schema"]["schema"]  # type: ignore[index]
    assert response_format["json_schema"]["strict"] is True  # type: ignore[index]


def test_structured_outputs_and_the_guided_fields() -> None:
    regex, grammar, schema = r"\d{3}", 'start: "yes" | "no"', {"type": "array"}
    expected = {"json": ("json", json.dumps(schema)), "regex": ("regex", regex), "grammar": ("grammar", grammar),
                "choice": ("choice", '["a", "b"]')}
    values = {"json": schema, "regex": regex, "grammar": grammar, "choice": ["a", "b"]}
    for key, value in values.items():
        for field, body in ((f"structured_outputs.{key}", {"structured_outputs": {key: value}}),
                            (f"guided_{key}", {f"guided_{key}": value})):
            for chat in (True, False):
                constraint = constraint_of(body, chat)
                assert constraint is not None and (constraint.kind, constraint.value, constraint.field) == (
                    *expected[key], field)
    assert constraint_of({"structured_outputs": {"json_object": True}}) == Constraint(
        "json", JSON_OBJECT_SCHEMA, "structured_outputs.json_object")
    as_text = constraint_of({"guided_json": '{"type": "string"}'})
    assert as_text is not None and as_text.value == '{"type": "string"}'
    assert constraint_of({"guided_decoding_backend": "xgrammar"}) is None


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "is required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format.json_schema.name", "is required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
         "response_format.json_schema.name", "pattern"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a" * 65}}},
         "response_format.json_schema.name", "pattern"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}},
         "response_format.json_schema.schema", "must be"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}},
         "response_format.json_schema.strict", "must be a boolean"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "must be 'text', 'json_object' or"),
        ({"response_format": {}}, "response_format.type", "is required"),
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got regex, choice"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "unknown key 'whitespace_pattern'"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "must be true"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "a JSON Schema is an object"),
        ({"structured_outputs": {"json": 5}}, "structured_outputs.json", "must be a JSON Schema"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1 item"),
        ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice[1]", "non-empty"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty"),
        ({"structured_outputs": "regex"}, "structured_outputs", "must be an object"),
        ({"guided_json": [1]}, "guided_json", "must be a JSON Schema"),
        ({"guided_choice": "a"}, "guided_choice", "must be a list"),
        ({"guided_regex": "a" * 70_000}, "guided_regex", "longer than 65536"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "cannot be combined with response_format"),
        ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json", "cannot be combined"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex",
         "cannot be combined with structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "cannot be combined with guided_regex"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ],
)
def test_constraint_fields_name_themselves_when_wrong(body: dict[str, Any], field: str, words: str) -> None:
    for chat in (True, False):
        error = error_of({"messages": CHAT, **body} if chat else {"prompt": "x", **body}, chat=chat)
        assert error.field == field and words in error.message, (chat, error)


def test_logit_bias() -> None:
    sampling = parse_request({"prompt": "x", "logit_bias": {"50256": -100, "3": 5.5, "0": 100}}, DEFAULTS,
                             chat=False).args.sampling
    assert sampling.logit_bias == ((0, 100.0), (3, 5.5), (50256, -100.0))
    assert parse_request({"messages": CHAT, "logit_bias": {}}, DEFAULTS, chat=True).args.sampling.logit_bias == ()


@pytest.mark.parametrize(
    ("bias", "words"),
    [
        ({"abc": 1}, "keys must be token ids"),
        ({"-1": 1}, "keys must be token ids"),
        ({"1.5": 1}, "keys must be token ids"),
        ({"12345678901": 1}, "keys must be token ids"),
        ({"5": 101}, "the bias of token '5' must be <= 100"),
        ({"5": -100.5}, "must be >= -100"),
        ({"5": "1"}, "must be a number"),
        ({"5": True}, "must be a number"),
        ({"5": None}, "must be a number"),
        ({"5": 1, "05": 2}, "token 5 given twice"),
        ({str(i): 1 for i in range(1025)}, "at most 1024"),
        ([[5, 1]], "must be an object"),
    ],
)
def test_bad_logit_bias_is_refused(bias: Any, words: str) -> None:
    for chat in (True, False):
        error = error_of({"messages": CHAT, "logit_bias": bias} if chat else {"prompt": "x", "logit_bias": bias},
                         chat=chat)
        assert error.field == "logit_bias" and words in error.message, error


# -- tools ---------------------------------------------------------------------------------------------------
def tools_request(**body: Any) -> Any:
    return parse_request({"messages": CHAT, "tools": TOOLS, **body}, DEFAULTS, chat=True)


def test_tool_choice_auto_none_required_and_named() -> None:
    auto = tools_request()
    assert auto.args.constraint is None and auto.tools == ToolOutput(named=False)
    assert json.loads(auto.args.tools) == TOOLS  # as sent, nulls left out
    explicit = tools_request(tool_choice="auto")
    assert explicit == dataclasses.replace(auto, args=dataclasses.replace(auto.args,
                                                                          request_id=explicit.args.request_id))
    none = tools_request(tool_choice="none")
    assert none.args.constraint is None and none.args.tools == "" and none.tools is None
    required = tools_request(tool_choice="required")
    assert required.tools == ToolOutput(named=False) and required.args.constraint is not None
    assert (required.args.constraint.kind, required.args.constraint.field) == ("grammar", "tools")
    assert required.args.constraint.value == tool_call_grammar([("get_weather", WEATHER), ("ping", None)], True)
    single = tools_request(tool_choice="required", parallel_tool_calls=False)
    assert single.args.constraint is not None and single.args.constraint.value == tool_call_grammar(
        [("get_weather", WEATHER), ("ping", None)], False)
    named = tools_request(tool_choice={"type": "function", "function": {"name": "ping"}})
    assert named.tools == ToolOutput(named=True) and named.args.constraint is not None
    assert named.args.constraint.value == tool_call_grammar([("ping", None)], True)
    assert json.loads(named.args.tools) == TOOLS  # every tool is shown, one may be called


def test_tools_beside_a_format() -> None:
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": answer}}
    auto = tools_request(response_format=fmt)  # a call, or the answer in the format
    assert auto.args.constraint is not None and auto.args.constraint.value == tool_call_grammar(
        [("get_weather", WEATHER), ("ping", None)], True, answer_schema=json.dumps(answer))
    required = tools_request(response_format=fmt, tool_choice="required")  # this turn calls: the format waits
    assert required.args.constraint == tools_request(tool_choice="required").args.constraint
    none = tools_request(response_format=fmt, tool_choice="none")
    assert none.args.constraint is not None and none.args.constraint.field == "response_format"


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", 'must be "none", "auto", "required" or'),
        ({"tool_choice": {"type": "function"}}, "tool_choice", "must be"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": None, "tool_choice": {"type": "function", "function": {"name": "ping"}}}, "tool_choice",
         "needs tools"),
        ({"tools": [*TOOLS, TOOLS[1]]}, "tools[2].function.name", "tools[1]'s name"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name", "pattern"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters", "must be an object"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type", "must be 'function'"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "is required"),
        ({"tools": [TOOLS[1]] * 129}, "tools", "at most 128"),
        ({"guided_regex": "a+"}, "guided_regex", 'only a JSON format'),
        ({"tool_choice": "required", "structured_outputs": {"json": {}}}, "structured_outputs",
         "the output is tool calls"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
    ],
)
def test_tool_errors_name_the_field(body: dict[str, Any], field: str, words: str) -> None:
    error = error_of({"messages": CHAT, "tools": TOOLS, **body}, chat=True)
    assert error.field == field and words in error.message, error


def test_completions_take_no_tools() -> None:
    error = error_of({"prompt": "x", "tools": TOOLS})
    assert (error.field, error.message) == ("tools", REFUSED_COMPLETION["tools"])
    assert error_of({"prompt": "x", "tool_choice": "required"}).field == "tool_choice"
    assert parse_request({"prompt": "x", "tools": [], "tool_choice": "none"}, DEFAULTS, chat=False).tools is None


def test_a_tool_calling_history() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
                {"role": "assistant", "content": [{"type": "text", "text": "It is sunny."}]}]
    args = parse_request({"messages": messages, "tools": TOOLS}, DEFAULTS, chat=True).args
    assert args.messages == (("user", "weather?"), ("assistant", ""), ("tool", "sunny"), ("assistant", "It is sunny."))
    assert [json.loads(extra) if extra else None for extra in args.message_extras] == [
        None, {"tool_calls": [call]}, {"tool_call_id": "call_1"}, None]
    assert parse_request({"messages": CHAT}, DEFAULTS, chat=True).args.message_extras == ()


@pytest.mark.parametrize(
    ("message", "field", "words"),
    [
        ({"role": "tool", "content": "x"}, "messages[1].tool_call_id", "is required"),
        ({"role": "tool", "content": "", "tool_call_id": "c"}, "messages[1].content", "must be a non-empty string"),
        ({"role": "assistant", "content": None}, "messages[1].content", "must be non-empty"),
        ({"role": "assistant"}, "messages[1].content", "must be non-empty"),
        ({"role": "assistant", "content": "", "tool_calls": []}, "messages[1].tool_calls", "at least 1 item"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]},
         "messages[1].tool_calls[0].function.arguments", "is required"),
        ({"role": "developer", "content": "x"}, "messages[1].role", "must be 'system', 'user', 'assistant' or "
                                                                   "'tool', got 'developer'"),
        ({"content": "x"}, "messages[1].role", "is required"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "messages[1].content",
         "only text is supported"),
    ],
)
def test_message_errors_name_the_message(message: dict[str, Any], field: str, words: str) -> None:
    error = error_of({"messages": [CHAT[0], message]}, chat=True)
    assert error.field == field and words in error.message, error


# -- tools: the answers -----------------------------------------------------------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def chunks_of(text: str, cuts: list[int], reason: str = "eos", index: int = 0) -> list[IndexedChunk]:
    bounds = [0, *cuts, len(text)]
    return [IndexedChunk(index, TokenChunk("r", [at], text[a:b], finish_reason=reason if at == len(cuts) else None,
                                           stats={"prompt_tokens": 3} if at == len(cuts) else None), "greedy")
            for at, (a, b) in enumerate(itertools.pairwise(bounds))]


def test_a_tool_call_answer() -> None:
    done = Collected(n=2)
    for item in chunks_of(f"\n{CALL}", [3]) + chunks_of("I do not know.", [2], index=1):
        done.add(item)
    body = ChatCompletionResponse.model_validate(completion_body("r", "m", done, chat=True, tools=ToolOutput()))
    called, text = body.choices
    assert called.finish_reason == "tool_calls" and called.message.content is None
    assert called.message.tool_calls is not None and len(called.message.tool_calls) == 1
    call = called.message.tool_calls[0]
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "get_weather",
                                                                                    {"city": "Paris"})
    assert call.id.startswith("call_")
    assert text.finish_reason == "stop" and text.message.content == "I do not know." and text.message.tool_calls is None
    named = completion_body("r", "m", done, chat=True, tools=ToolOutput(named=True))
    assert named["choices"][0]["finish_reason"] == "stop"  # as OpenAI answers a named tool_choice
    cut = Collected(n=1)
    for item in chunks_of(CALL, [5], reason="length"):
        cut.add(item)
    assert completion_body("r", "m", cut, chat=True, tools=ToolOutput())["choices"][0]["finish_reason"] == "length"
    plain = completion_body("r", "m", done, chat=True)  # no tools: the text as it is
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": f"\n{CALL}"}


AUTO = ToolOutput()


def streamed_answer(items: list[IndexedChunk], tools: ToolOutput | None = AUTO) -> dict[int, dict[str, Any]]:
    """What a client makes of the SSE events (as the openai SDK's stream accumulates them), per choice."""
    writer = SSEWriter("r", "m", chat=True, include_usage=True, tools=tools)
    answers: dict[int, dict[str, Any]] = {}
    for item in items:
        events = writer.events(item)
        assert events
        for at, event in enumerate(events):
            chunk = ChatCompletionChunk.model_validate(json.loads(event.removeprefix("data: ")))
            assert (chunk.specserve is not None) == (at == 0) and chunk.usage is None
            (choice,) = chunk.choices
            answer = answers.setdefault(choice.index, {"content": "", "calls": [], "finish": [], "roles": 0})
            answer["roles"] += choice.delta.role == "assistant"
            answer["content"] += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index == len(answer["calls"]) and delta.type == "function"
                    assert delta.function is not None and delta.function.arguments == ""
                    answer["calls"].append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                else:
                    assert delta.function is not None and delta.function.name is None
                    answer["calls"][delta.index]["arguments"] += delta.function.arguments or ""
            answer["finish"].append(choice.finish_reason)
    return answers


@pytest.mark.parametrize("text", [CALL, f"Checking.\n{CALL}\n{CALL.replace('Paris', 'Oslo')} done", "no calls",
                                  "<tool_call> broken </tool_call>", f"  \n{CALL}"])
def test_a_streamed_tool_call_answer_equals_the_whole(text: str) -> None:
    whole = Collected(n=1)
    for item in chunks_of(text, []):
        whole.add(item)
    (expected,) = completion_body("r", "m", whole, chat=True, tools=ToolOutput())["choices"]
    for cut in range(len(text) + 1):  # the text in two chunks, cut anywhere; and one character a chunk
        for cuts in ([cut], list(range(1, len(text)))) if cut == 0 else ([cut],):
            (answer,) = streamed_answer(chunks_of(text, cuts)).values()
            assert answer["roles"] == 1 and answer["finish"][-1] == expected["finish_reason"]
            assert answer["finish"][:-1] == [None] * (len(answer["finish"]) - 1)
            assert answer["content"] == (expected["message"]["content"] or "")  # null: no content deltas
            assert [(c["name"], c["arguments"]) for c in answer["calls"]] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in expected["message"].get("tool_calls", [])]
            assert all(c["id"].startswith("call_") for c in answer["calls"])


def test_streamed_choices_read_their_own_calls() -> None:
    first, second = chunks_of(CALL, [4, 30]), chunks_of(f"text then {CALL}", [12], index=1)
    interleaved = [item for pair in itertools.zip_longest(first, second) for item in pair if item is not None]
    answers = streamed_answer(interleaved)
    assert answers[0]["content"] == "" and [c["name"] for c in answers[0]["calls"]] == ["get_weather"]
    assert answers[1]["content"] == "text then " and len(answers[1]["calls"]) == 1
    assert answers[0]["finish"][-1] == answers[1]["finish"][-1] == "tool_calls"
    named = streamed_answer(chunks_of(CALL, [9]), tools=ToolOutput(named=True))
    assert named[0]["finish"][-1] == "stop"
    plain = streamed_answer(chunks_of(CALL, [9]), tools=None)  # no tools: the text as it is
    assert plain[0]["content"] == CALL and plain[0]["calls"] == []
