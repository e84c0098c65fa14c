"""The gRPC fields of tool calling (specserve_types/protocol.py): GenerateRequest.tools, tool_choice,
parallel_tool_calls and ChatMessage.tool_calls / tool_call_id into GenerateArgs and the output's ToolOutput, each
tool_choice as the OpenAI door resolves it (the same constraint, definitions and message extras for the same
conversation), their errors naming the gRPC field; GenerateChunk.tool_calls both ways."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cluster.serving.openai_api import parse_request
from specserve_types.api import Constraint, InvalidRequestError, TokenChunk
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.protocol import (
    IndexedChunk,
    ServerDefaults,
    args_from_proto,
    chunk_from_proto,
    chunk_to_proto,
    request_from_proto,
)
from specserve_types.tools import MAX_TOOLS, ToolCall, ToolOutput, tool_call_grammar

DEFAULTS = ServerDefaults("tiny", draft="ngram")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# OpenAI's tools and the same as gRPC's
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}}]
PB_TOOLS = [pb.Tool(name="get_weather", description="Weather", parameters_json=json.dumps(WEATHER)),
            pb.Tool(name="ping")]
FUNCTIONS: list[tuple[str, dict[str, Any] | None]] = [("get_weather", WEATHER), ("ping", None)]


def wire(request: pb.GenerateRequest) -> pb.GenerateRequest:
    return pb.GenerateRequest.FromString(request.SerializeToString())


def served(**fields: Any) -> tuple[Any, ToolOutput | None]:
    fields = {"chat": True, "messages": [pb.ChatMessage(role="user", content="hi")], "tools": PB_TOOLS, **fields}
    return request_from_proto(wire(pb.GenerateRequest(**fields)), DEFAULTS)


def error_of(**fields: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        served(**fields)
    return info.value


def test_tool_choice_auto_none_required_and_named() -> None:
    auto, output = served()
    assert auto.constraint is None and output == ToolOutput(named=False)
    assert json.loads(auto.tools) == TOOLS  # OpenAI's shape, empty fields left out
    explicit, explicit_output = served(tool_choice=pb.ToolChoice(mode="auto"))
    assert (explicit.tools, explicit.constraint, explicit_output) == (auto.tools, None, output)
    assert served(tool_choice=pb.ToolChoice())[1] == output  # no kind set: unset
    none, none_output = served(tool_choice=pb.ToolChoice(mode="none"))
    assert none.constraint is None and none.tools == "" and none_output is None
    required, required_output = served(tool_choice=pb.ToolChoice(mode="required"))
    assert required_output == ToolOutput(named=False)
    assert required.constraint == Constraint("grammar", tool_call_grammar(FUNCTIONS, True), "tools")
    single, _ = served(tool_choice=pb.ToolChoice(mode="required"), parallel_tool_calls=False)
    assert single.constraint is not None and single.constraint.value == tool_call_grammar(FUNCTIONS, False)
    assert served(tool_choice=pb.ToolChoice(mode="required"), parallel_tool_calls=True)[0].constraint == \
        required.constraint
    named, named_output = served(tool_choice=pb.ToolChoice(function="ping"))
    assert named_output == ToolOutput(named=True)
    assert named.constraint is not None and named.constraint.value == tool_call_grammar([("ping", None)], True)
    assert named.tools == auto.tools  # every tool is shown, one may be called


def test_no_tools_is_no_tool_output() -> None:
    args, output = request_from_proto(pb.GenerateRequest(text="x"), DEFAULTS)
    assert (args.tools, args.message_extras, args.constraint, output) == ("", (), None, None)
    args, output = served(tools=[], tool_choice=pb.ToolChoice(mode="none"))
    assert (args.tools, output) == ("", None)
    assert args_from_proto(wire(pb.GenerateRequest(chat=True, text="x", tools=PB_TOOLS)), DEFAULTS).tools == \
        served()[0].tools


def test_tools_beside_the_constraint() -> None:
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    schema = pb.Constraint(json_schema=json.dumps(answer))
    auto, _ = served(constraint=schema)  # a call, or the answer in the format
    assert auto.constraint == Constraint("grammar", tool_call_grammar(FUNCTIONS, True, json.dumps(answer)), "tools")
    none, _ = served(constraint=schema, tool_choice=pb.ToolChoice(mode="none"))
    assert none.constraint == Constraint("json", json.dumps(answer), "constraint.json_schema")
    assert served(constraint=pb.Constraint(json_object=True))[0].constraint is not None


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"tool_choice": pb.ToolChoice(function="nope")}, "tool_choice", "names function 'nope', which is not in tools"),
        ({"tool_choice": pb.ToolChoice(function="")}, "tool_choice", "not in tools"),
        ({"tool_choice": pb.ToolChoice(mode="sometimes")}, "tool_choice", 'must be "none", "auto", "required"'),
        ({"tool_choice": pb.ToolChoice(mode="")}, "tool_choice", "got ''"),
        ({"tools": [], "tool_choice": pb.ToolChoice(mode="required")}, "tool_choice", "needs tools"),
        ({"tools": [], "tool_choice": pb.ToolChoice(function="ping")}, "tool_choice", "needs tools"),
        ({"tools": [*PB_TOOLS, PB_TOOLS[1]]}, "tools[2].name", "'ping' is also tools[1]'s name"),
        ({"tools": [pb.Tool(name="get weather")]}, "tools[0].name", "1 to 64 of [a-zA-Z0-9_-]"),
        ({"tools": [pb.Tool(name="")]}, "tools[0].name", "got ''"),
        ({"tools": [pb.Tool(name="f" * 65)]}, "tools[0].name", "1 to 64"),
        ({"tools": [PB_TOOLS[1], pb.Tool(name="f", parameters_json="{oops")]}, "tools[1].parameters_json",
         "is not valid JSON"),
        ({"tools": [pb.Tool(name="f", parameters_json="[]")]}, "tools[0].parameters_json",
         "must be a JSON Schema object, got list"),
        ({"tools": [pb.Tool(name=f"f{i}") for i in range(MAX_TOOLS + 1)]}, "tools", f"at most {MAX_TOOLS}"),
        ({"chat": False, "messages": [], "text": "x"}, "tools", "tools need chat=true"),
        ({"constraint": pb.Constraint(regex="a+")}, "constraint", "only a JSON format"),
        ({"constraint": pb.Constraint(json_object=True), "tool_choice": pb.ToolChoice(mode="required")},
         "constraint", "the output is tool calls"),
        ({"constraint": pb.Constraint(choice=pb.Choices(choices=["a"])), "tool_choice": pb.ToolChoice(function="ping")},
         "constraint", "the output is tool calls"),
    ],
)
def test_tool_errors_name_the_field(fields: dict[str, Any], field: str, words: str) -> None:
    error = error_of(**fields)
    assert error.field == field and words in error.message, error
    assert str(error).startswith(f"{field}: ")  # the INVALID_ARGUMENT details


def test_a_text_request_takes_no_tool_choice_but_none() -> None:
    error = error_of(chat=False, messages=[], text="x", tools=[], tool_choice=pb.ToolChoice(mode="auto"))
    assert (error.field, error.message) == ("tool_choice", "needs tools")
    args, output = served(chat=False, messages=[], text="x", tools=[], tool_choice=pb.ToolChoice(mode="none"))
    assert (args.prompt_text, output) == ("x", None)


# -- the history ----------------------------------------------------------------------------------------------
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "It is sunny. Anything else?"},
    {"role": "user", "content": "Oslo?"}]


def pb_history() -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m.get("content") or "", tool_call_id=m.get("tool_call_id", ""),
                           tool_calls=[pb.ToolCall(id=c["id"], name=c["function"]["name"],
                                                   arguments=c["function"]["arguments"])
                                       for c in m.get("tool_calls", [])]) for m in HISTORY]


@pytest.mark.parametrize(
    ("http", "grpc"),
    [
        ({}, {}),
        ({"tool_choice": "required"}, {"tool_choice": pb.ToolChoice(mode="required")}),
        ({"tool_choice": "none"}, {"tool_choice": pb.ToolChoice(mode="none")}),
        ({"tool_choice": {"type": "function", "function": {"name": "ping"}}, "parallel_tool_calls": False},
         {"tool_choice": pb.ToolChoice(function="ping"), "parallel_tool_calls": False}),
    ],
)
def test_a_tool_calling_history_is_what_the_http_door_makes(http: dict[str, Any], grpc: dict[str, Any]) -> None:
    """The same conversation through both doors: the same messages, extras, tool definitions, constraint and
    output reading."""
    want = parse_request({"messages": HISTORY, "tools": TOOLS, **http}, DEFAULTS, chat=True)
    got, output = served(messages=pb_history(), **grpc)
    assert got.messages == want.args.messages == (
        ("system", "be brief"), ("user", "weather?"), ("assistant", ""), ("tool", "sunny"),
        ("assistant", "It is sunny. Anything else?"), ("user", "Oslo?"))
    assert got.message_extras == want.args.message_extras
    assert [json.loads(extra) if extra else None for extra in got.message_extras] == [
        None, None, {"tool_calls": [CALL]}, {"tool_call_id": "call_1"}, None, None]
    assert (got.tools, got.constraint, output) == (want.args.tools, want.args.constraint, want.tools)


def test_text_after_a_history_is_the_last_user_message() -> None:
    args, _ = served(messages=pb_history()[:4], text="Oslo?")
    assert args.messages[-1] == ("user", "Oslo?") and len(args.message_extras) == 5 and args.message_extras[-1] == ""
    assert served(messages=[], text="hi")[0].message_extras == ()  # no message has extras


@pytest.mark.parametrize(
    ("message", "field", "words"),
    [
        (pb.ChatMessage(role="tool", content="x"), "messages[1].tool_call_id", "is required"),
        (pb.ChatMessage(role="tool", content="x", tool_call_id="c" * 129), "messages[1].tool_call_id", "longer than"),
        (pb.ChatMessage(role="tool", tool_call_id="c"), "messages[1].content", "must be non-empty"),
        (pb.ChatMessage(role="user", content="x", tool_call_id="c"), "messages[1].tool_call_id",
         "only a tool message"),
        (pb.ChatMessage(role="assistant"), "messages[1].content", "must be non-empty"),
        (pb.ChatMessage(role="user", content="x", tool_calls=[pb.ToolCall(id="c", name="f", arguments="{}")]),
         "messages[1].tool_calls", "only an assistant message"),
        (pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c", name="f"), pb.ToolCall(id="d")]),
         "messages[1].tool_calls[1].name", "must be non-empty"),
        (pb.ChatMessage(role="developer", content="x"), "messages[1].role", "must be one of"),
    ],
)
def test_message_errors_name_the_message(message: pb.ChatMessage, field: str, words: str) -> None:
    error = error_of(messages=[pb.ChatMessage(role="user", content="hi"), message])
    assert error.field == field and words in error.message, error


def test_an_assistant_call_without_content_is_taken() -> None:
    args, _ = served(messages=[pb.ChatMessage(role="user", content="hi"), pb.ChatMessage(
        role="assistant", tool_calls=[pb.ToolCall(id="c", name="ping")])])
    assert json.loads(args.message_extras[1]) == {
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "ping", "arguments": ""}}]}


# -- the chunk ------------------------------------------------------------------------------------------------
def test_tool_calls_round_trip_on_the_chunk() -> None:
    calls = (ToolCall("get_weather", '{"city": "Paris"}', "call_1"), ToolCall("ping", "{}", "call_2"))
    item = IndexedChunk(1, TokenChunk("r", [5], "</tool_call>", finish_reason="eos"), "greedy", calls)
    message = chunk_to_proto(item)
    assert [(c.id, c.name, c.arguments) for c in message.tool_calls] == [
        ("call_1", "get_weather", '{"city": "Paris"}'), ("call_2", "ping", "{}")]
    assert chunk_from_proto(pb.GenerateChunk.FromString(message.SerializeToString())) == item
    assert chunk_from_proto(pb.GenerateChunk(request_id="r")).tool_calls == ()


def test_new_field_numbers() -> None:
    request = {f.name: f.number for f in pb.GenerateRequest.DESCRIPTOR.fields}
    assert (request["tools"], request["tool_choice"], request["parallel_tool_calls"]) == (41, 42, 43)
    message = {f.name: f.number for f in pb.ChatMessage.DESCRIPTOR.fields}
    assert message == {"role": 1, "content": 2, "tool_calls": 3, "tool_call_id": 4}
    assert {f.name: f.number for f in pb.GenerateChunk.DESCRIPTOR.fields}["tool_calls"] == 12
    assert {f.name: f.number for f in pb.Tool.DESCRIPTOR.fields} == {"name": 1, "description": 2, "parameters_json": 3}
    assert {f.name: f.number for f in pb.ToolChoice.DESCRIPTOR.fields} == {"mode": 1, "function": 2}
    assert {f.name: f.number for f in pb.ToolCall.DESCRIPTOR.fields} == {"id": 1, "name": 2, "arguments": 3}
