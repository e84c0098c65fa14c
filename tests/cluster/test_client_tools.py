"""The client's keyword arguments of tool calling (cluster/client.py: tools=, tool_choice=, parallel_tool_calls=,
messages= as OpenAI's dicts) become the server's GenerateArgs as the HTTP door makes them of the same body; collect
gathers each completion's calls."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.client import build_request, collect
from cluster.serving.openai_api import parse_request
from specserve_types.api import InvalidRequestError, TokenChunk
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.protocol import IndexedChunk, ServerDefaults, request_from_proto
from specserve_types.tools import ToolCall, ToolOutput

DEFAULTS = ServerDefaults("m", draft="ngram")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
MESSAGES: list[Any] = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None,
                                                                 "tool_calls": [CALL]},
                       {"role": "tool", "content": "rain", "tool_call_id": "call_1"}]


def served(**fields: Any) -> tuple[Any, ToolOutput | None]:
    request = pb.GenerateRequest.FromString(build_request(chat=True, **fields).SerializeToString())
    return request_from_proto(request, DEFAULTS)


@pytest.mark.parametrize(
    "extra",
    [{}, {"tool_choice": "auto"}, {"tool_choice": "none"}, {"tool_choice": "required", "parallel_tool_calls": False},
     {"tool_choice": {"type": "function", "function": {"name": "ping"}}}],
)
def test_kwargs_mirror_the_http_body(extra: dict[str, Any]) -> None:
    want = parse_request({"messages": MESSAGES, "tools": TOOLS, **extra}, DEFAULTS, chat=True)
    args, output = served(messages=MESSAGES, tools=TOOLS, **extra)
    assert (args.messages, args.message_extras, args.tools, args.constraint, output) == (
        want.args.messages, want.args.message_extras, want.args.tools, want.args.constraint, want.tools)


def test_pairs_objects_and_messages_mix() -> None:
    args, _ = served(messages=[("system", "be brief"), pb.ChatMessage(role="user", content="hi")],
                     tools=[pb.Tool(name="ping"), {"type": "function", "function": {"name": "f",
                                                                                     "parameters": '{"type": "object"}'}}],
                     tool_choice=pb.ToolChoice(function="f"))
    assert args.messages == (("system", "be brief"), ("user", "hi")) and args.message_extras == ()
    assert args.constraint is not None and '"f"' in args.constraint.value
    args, _ = served(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "ping", "arguments": {"a": 1}}}]}, ("user", "go")])
    assert '"arguments": "{\\"a\\": 1}"' in args.message_extras[0]  # an object's JSON text


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tools": [{"name": "f"}]}, "tools[0]"),
        ({"tools": ["f"]}, "tools[0]"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": 3}, "tool_choice"),
        ({"messages": [{"content": "x"}]}, "messages[0]"),
    ],
)
def test_bad_kwargs_raise_before_anything_is_sent(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        build_request("x", **fields)
    assert info.value.field == field


def test_collect_gathers_the_calls() -> None:
    first, second = ToolCall("ping", "{}", "call_a"), ToolCall("f", "{}", "call_b")
    chunks = [IndexedChunk(0, TokenChunk("r", [1], "<tool_call>..."), "greedy", (first,)),
              IndexedChunk(1, TokenChunk("r", [2], "no", finish_reason="eos"), "greedy"),
              IndexedChunk(0, TokenChunk("r", [3], "...", finish_reason="tool_calls"), "greedy",  # type: ignore[arg-type]
                           (second,))]
    samples = collect(iter(chunks))
    assert samples[0]["tool_calls"] == [first, second] and samples[0]["finish_reason"] == "tool_calls"
    assert samples[1]["tool_calls"] == []
