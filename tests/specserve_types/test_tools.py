"""Tool choice on plain data (specserve_types/tools.py): resolve_tools for each tool_choice, its refusals, the finish
rule of an output that made calls, the message extras; its bounds are the OpenAI door's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cluster.serving import openai_models
from specserve_types.api import Constraint, InvalidRequestError
from specserve_types.tools import (
    FUNCTION_NAME,
    MAX_TOOLS,
    ResolvedTools,
    ToolOutput,
    ends_in_calls,
    message_extra,
    resolve_tools,
    tool_call_constraint,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                               {"type": "function", "function": {"name": "ping"}}]
FUNCTIONS: list[tuple[str, dict[str, Any] | None]] = [("get_weather", WEATHER), ("ping", None)]
JSON = Constraint("json", '{"type": "object"}', "constraint.json_object")


def test_each_choice() -> None:
    definitions = json.dumps(TOOLS)
    for choice in (None, "auto"):
        assert resolve_tools(TOOLS, choice) == ResolvedTools(None, definitions, ToolOutput())
    assert resolve_tools(TOOLS, "none") == (None, "", None)
    assert resolve_tools(TOOLS, "none", [JSON]) == (JSON, "", None)
    assert resolve_tools(TOOLS, "required", parallel=False) == (tool_call_constraint(FUNCTIONS, False), definitions,
                                                                ToolOutput())
    assert resolve_tools(TOOLS, None, function="ping") == (tool_call_constraint([("ping", None)], True), definitions,
                                                           ToolOutput(named=True))
    assert resolve_tools(TOOLS, "auto", [JSON]).constraint == tool_call_constraint(FUNCTIONS, True, JSON.value)
    assert resolve_tools([], None, [JSON]) == (JSON, "", None) and resolve_tools([], "none") == (None, "", None)


@pytest.mark.parametrize(
    ("tools", "choice", "kwargs", "field", "message"),
    [
        (TOOLS, "maybe", {}, "tool_choice", "must be \"none\", \"auto\", \"required\" or name a function, got 'maybe'"),
        ([], "auto", {}, "tool_choice", "needs tools"),
        ([], None, {"function": "f"}, "tool_choice", "needs tools"),
        (TOOLS, None, {"function": "f"}, "tool_choice", "names function 'f', which is not in tools"),
        ([*TOOLS, TOOLS[0]], None, {}, "tools[2].function.name", "'get_weather' is also tools[0]'s name"),
        ([*TOOLS, TOOLS[0]], None, {"name_field": "tools[{}].name"}, "tools[2].name",
         "'get_weather' is also tools[0]'s name"),
        (TOOLS, "auto", {"found": [Constraint("regex", "a", "guided_regex")]}, "guided_regex",
         "with tools (tool_choice \"auto\") only a JSON format can be asked for"),
        (TOOLS, "required", {"found": [JSON]}, "constraint",
         "cannot be combined with tool_choice \"required\" or a named function: the output is tool calls"),
    ],
)
def test_refusals(tools: list[dict[str, Any]], choice: str | None, kwargs: dict[str, Any], field: str,
                  message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        resolve_tools(tools, choice, **kwargs)
    assert (info.value.field, info.value.message) == (field, message)


def test_response_format_waits_while_the_turn_calls() -> None:
    answer = Constraint("json", "{}", "response_format")
    assert resolve_tools(TOOLS, "required", [answer]).constraint == tool_call_constraint(FUNCTIONS, True)


def test_the_finish_rule() -> None:
    assert ends_in_calls("eos", 1, ToolOutput()) and ends_in_calls("stop", 2, ToolOutput())
    assert not ends_in_calls("eos", 0, ToolOutput())
    assert not ends_in_calls("length", 1, ToolOutput())
    assert not ends_in_calls("eos", 1, ToolOutput(named=True))
    assert not ends_in_calls("eos", 1, None)


def test_message_extra() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert message_extra() == "" and message_extra([]) == ""
    assert json.loads(message_extra([call])) == {"tool_calls": [call]}
    assert message_extra(tool_call_id="c\u00e9") == '{"tool_call_id": "c\u00e9"}'  # not ASCII-escaped


def test_bounds_are_the_openai_doors() -> None:
    assert MAX_TOOLS == openai_models.MAX_TOOLS
    pattern = openai_models.FunctionDefinition.model_json_schema()["properties"]["name"]["pattern"]
    assert f"^{FUNCTION_NAME.pattern}$" == pattern
