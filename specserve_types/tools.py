"""Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`) as both front doors take them: what a
request's tools and tool_choice make of its constraint (`resolve_tools`), the grammar of `tool_choice: "required"`
or a named function (Qwen2.5's `<tool_call>` blocks), a message's tool-calling extras, and the finish reason of an
output that made calls (docs/api.md, "Tool calls").

Plain data, no tokenizer and no HTTP models: the OpenAI door (cluster/serving/openai_api.py) and the gRPC one
(specserve_types/protocol.py: args_from_proto) resolve the same tools to the same constraint and the same
definitions. The prompt and the reading of the output are cluster/serving/tool_calls.py's, which re-exports this.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from specserve_types.api import Constraint, InvalidRequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a function without `parameters`: any object of arguments
MAX_TOOLS = 128  # tools a request (as cluster/serving/openai_models.py's MAX_TOOLS)
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's function names (openai_models.FunctionName)
TOOL_CHOICE_MODES = ("none", "auto", "required")  # tool_choice besides a named function


# -- the grammar --------------------------------------------------------------------------------------------
def _rebased(value: Any, base: str) -> Any:
    """`value` with its local `$ref`s ("#/$defs/x", "#") pointing into `base` (where it now sits)."""
    if isinstance(value, dict):
        return {key: (base + item[1:] if key == "$ref" and isinstance(item, str) and item.startswith("#")
                      else _rebased(item, base)) for key, item in value.items()}
    if isinstance(value, list):
        return [_rebased(item, base) for item in value]
    return value


def call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of one call's body: `{"name": name, "arguments": <parameters>}`, name first."""
    arguments = _rebased(parameters, "#/properties/arguments") if parameters is not None else ANY_OBJECT
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_grammar(functions: Sequence[tuple[str, dict[str, Any] | None]], parallel: bool = True,
                      answer_schema: str | None = None) -> str:
    """llguidance Lark: one call (several, newline-separated, if `parallel`) of one of `functions` (name,
    parameters), each call's arguments matching that function's parameters; with `answer_schema` (JSON schema
    text) the output may instead be a JSON answer matching it (tool_choice "auto" with a JSON response_format)."""
    if not functions:
        raise ValueError("no functions")
    more = ' ("\\n" call)*' if parallel else ""
    alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
    lines = [f"calls: call{more}", f'call: "{OPEN}\\n" ({alternatives}) "\\n{CLOSE}"']
    lines += [f"fn_{i}: %json {json.dumps(call_schema(name, parameters))}"
              for i, (name, parameters) in enumerate(functions)]
    if answer_schema is not None:
        lines = ["start: calls | answer", f"answer: %json {json.dumps(json.loads(answer_schema))}", *lines]
    else:
        lines = ["start: calls", *lines]
    return "\n".join(lines) + "\n"


def tool_call_constraint(functions: Sequence[tuple[str, dict[str, Any] | None]], parallel: bool,
                         answer_schema: str | None = None, field_name: str = "tools") -> Constraint:
    return Constraint("grammar", tool_call_grammar(functions, parallel, answer_schema), field_name)


# -- tool_choice ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolOutput:
    """A chat request with tools (tool_choice other than "none"): its output is read for tool calls."""

    named: bool = False  # tool_choice named a function: finish_reason stays "stop", as OpenAI's


class ResolvedTools(NamedTuple):
    """What a chat request's tools make: its constraint, the tools for the chat template (GenerateArgs.tools: JSON,
    "" for none) and how to read its output (None: not read for calls)."""

    constraint: Constraint | None
    definitions: str
    output: ToolOutput | None


def resolve_tools(tools: Sequence[Mapping[str, Any]], choice: str | None, found: Sequence[Constraint] = (), *,
                  function: str | None = None, parallel: bool = True,
                  name_field: str = "tools[{}].function.name") -> ResolvedTools:
    """A chat request's constraint, tool definitions and output reading from its `tools` (OpenAI's dicts:
    {"type": "function", "function": {"name", "description", "parameters", ...}}, names already checked one by
    one), its tool_choice (`choice` "none" | "auto" | "required" | None (unset), or `function`: the named one),
    `parallel` (parallel_tool_calls) and the constraint the request asks for otherwise (`found`: none or one, its
    field naming the refusals). Raises InvalidRequestError: `tool_choice` without tools or naming no tool, a name
    given twice (`name_field` formatted with the later index), a constraint that cannot go beside tools."""
    if function is None and choice not in (None, *TOOL_CHOICE_MODES):
        raise InvalidRequestError("tool_choice", f"must be \"none\", \"auto\", \"required\" or name a function, "
                                                 f"got {choice!r}")
    if not tools:
        if function is not None or choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return ResolvedTools((found[0] if found else None), "", None)
    seen: dict[str, int] = {}
    for index, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            raise InvalidRequestError(name_field.format(index), f"{name!r} is also tools[{seen[name]}]'s name")
        seen[name] = index
    if function is None and choice == "none":  # the tools are not shown, the output not read for calls
        return ResolvedTools((found[0] if found else None), "", None)
    definitions = json.dumps(list(tools), ensure_ascii=False)
    functions = [(tool["function"]["name"], tool["function"].get("parameters")) for tool in tools]
    if function is None and choice in (None, "auto"):
        if not found:
            return ResolvedTools(None, definitions, ToolOutput())
        if found[0].kind != "json":
            raise InvalidRequestError(found[0].field.split(".")[0], "with tools (tool_choice \"auto\") only a JSON "
                                                                    "format can be asked for")
        return ResolvedTools(tool_call_constraint(functions, parallel, answer_schema=found[0].value), definitions,
                             ToolOutput())
    if found and found[0].field != "response_format":  # response_format is the text answer's: this turn calls
        raise InvalidRequestError(found[0].field.split(".")[0], "cannot be combined with tool_choice \"required\" or "
                                                                "a named function: the output is tool calls")
    if function is not None:
        if function not in seen:
            raise InvalidRequestError("tool_choice", f"names function {function!r}, which is not in tools")
        return ResolvedTools(tool_call_constraint([functions[seen[function]]], parallel), definitions,
                             ToolOutput(named=True))
    return ResolvedTools(tool_call_constraint(functions, parallel), definitions, ToolOutput())


# -- the answer ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    """One call an output made (cluster/serving/tool_calls.py reads them)."""

    name: str
    arguments: str  # JSON text (OpenAI's `function.arguments`)
    id: str = ""

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def ends_in_calls(reason: str | None, calls: int, tools: ToolOutput | None) -> bool:
    """Whether an output's finish reason is "tool_calls" (OpenAI's): it made calls and ended by itself (`stop` or
    `eos`), in a request whose tool_choice named no function (a named one answers "stop", as OpenAI's)."""
    return bool(calls) and reason in ("stop", "eos") and tools is not None and not tools.named


# -- the history ----------------------------------------------------------------------------------------------
def message_extra(tool_calls: Sequence[Mapping[str, Any]] | None = None, tool_call_id: str | None = None) -> str:
    """A chat message's GenerateArgs.message_extras entry: "" or the JSON object of its tool-calling keys (an
    assistant's `tool_calls`, OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}; a tool
    result's `tool_call_id`)."""
    extra: dict[str, Any] = {}
    if tool_calls:
        extra["tool_calls"] = [dict(call) for call in tool_calls]
    if tool_call_id is not None:
        extra["tool_call_id"] = tool_call_id
    return json.dumps(extra, ensure_ascii=False) if extra else ""
