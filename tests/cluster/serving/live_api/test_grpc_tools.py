"""Tool calls through the gRPC API of the live cluster (live_api/conftest.py), with SpecServeClient and the real
engine, as test_openai_constrained.py asks the HTTP door: tool_choice "required" returns GenerateChunk.tool_calls
whose arguments validate against the function's schema, finish_reason "tool_calls"; a named function calls only it;
a greedy request's calls equal the HTTP door's for the same body; a tool-calling history is taken; a schema the
engine cannot compile is INVALID_ARGUMENT naming `tools`; then no KV is leaked. Run inside the loopback-only
namespace (scripts/in-netns.sh)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from cluster.client import SpecServeClient, collect
from cluster.serving.config import ClusterConfig
from specserve_types.api import InvalidRequestError
from specserve_types.tools import ToolCall
from tests.cluster.serving.live_api.helpers import assert_no_leaks, http
from tests.cluster.serving.live_api.test_openai_constrained import ASK, CALL_TOKENS, MODEL, SCHEMAS, TOOLS

pytestmark = pytest.mark.timeout(300)


def generate(client: SpecServeClient, **fields: Any) -> dict[int, dict[str, Any]]:
    return collect(client.generate(chat=True, messages=ASK, tools=TOOLS, **{"max_tokens": CALL_TOKENS, **fields}))


def assert_calls(calls: list[ToolCall], names: frozenset[str] = frozenset(SCHEMAS)) -> None:
    assert calls, calls
    for call in calls:
        assert call.id.startswith("call_") and call.name in names, call
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_required_returns_calls_matching_the_schema(client: SpecServeClient) -> None:
    (sample,) = generate(client, tool_choice="required", parallel_tool_calls=False).values()
    assert sample["finish_reason"] == "tool_calls", sample
    assert_calls(sample["tool_calls"])
    assert len(sample["tool_calls"]) == 1 and sample["text"].strip().startswith("<tool_call>")  # the raw text


def test_a_named_function(client: SpecServeClient) -> None:
    (sample,) = generate(client, parallel_tool_calls=False,
                         tool_choice={"type": "function", "function": {"name": "get_time"}}).values()
    assert sample["finish_reason"] in ("stop", "eos"), sample  # not "tool_calls": OpenAI answers a named one "stop"
    assert_calls(sample["tool_calls"], names=frozenset({"get_time"}))


def test_n2_each_completion_calls(client: SpecServeClient) -> None:
    samples = generate(client, tool_choice="required", parallel_tool_calls=False, n=2, temperature=0.8, seed=11)
    assert sorted(samples) == [0, 1]
    for sample in samples.values():
        assert sample["finish_reason"] == "tool_calls", sample
        assert_calls(sample["tool_calls"])


def test_the_calls_are_the_http_doors(cluster: ClusterConfig, client: SpecServeClient) -> None:
    """Greedy, the same body through both doors: the same prompt, constraint and output, read into the same calls."""
    (sample,) = generate(client, tool_choice="required").values()
    answer = http("/v1/chat/completions", {"model": MODEL, "messages": ASK, "tools": TOOLS,
                                           "tool_choice": "required", "max_tokens": CALL_TOKENS})
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    assert [(c.name, c.arguments) for c in sample["tool_calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]
    assert (sample["finish_reason"] == "tool_calls") == (choice["finish_reason"] == "tool_calls")


def test_auto_and_a_tool_calling_history(client: SpecServeClient) -> None:
    (auto,) = generate(client, max_tokens=32).values()
    assert auto["finish_reason"] in ("stop", "eos", "length", "tool_calls")
    history: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    (after,) = collect(client.generate(chat=True, messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=16)).values()
    assert after["text"] and after["tool_calls"] == []


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
          "tool_choice": "required"}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{oops"}}]},
         "tools[0].parameters_json"),
    ],
)
def test_what_the_engine_cannot_take_names_the_field(client: SpecServeClient, fields: dict[str, Any],
                                                     field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        collect(client.generate(chat=True, messages=ASK, max_tokens=4, **{"tools": TOOLS, **fields}))
    assert info.value.field == field, info.value


def test_nothing_leaked(cluster: ClusterConfig) -> None:
    assert_no_leaks()
