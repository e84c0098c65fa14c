"""Tool calls in Qwen2.5's format, for both front doors (docs/api.md, "Tool calls"): the prompt, the grammar of
`tool_choice: "required"` or a named function, and the output read back into OpenAI's `tool_calls` (the HTTP
door's `message.tool_calls`, gRPC's `GenerateChunk.tool_calls`). The grammar, `resolve_tools` (what `tools` and
`tool_choice` make of a request) and the answer's shapes are plain data shared with the gRPC request's parsing:
they live in specserve_types/tools.py and are re-exported here.

The model is shown the tools by its chat template (`apply_chat_template(..., tools=...)`; a template that does not
render tools, such as SmolLM2's, gets them in its system message instead, in a short version of Qwen2.5's words)
and calls one as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several calls one after the other, separated by a newline. `required` and a named function constrain the output to
such calls (a llguidance Lark grammar whose calls embed, with `%json`, a schema of the name and the function's
`parameters`); `auto` leaves the model free and the calls are read from what it wrote.

Reading the output (`parse_tool_calls`, or `ToolCallStream` for a stream, which gives the same calls and content for
any split of the text into deltas): each `<tool_call>...</tool_call>` block whose body is a JSON object with a
`name` (a non-empty string) and `arguments` (an object, or a string: kept as it is; absent: `{}`) is a call; any other
block, and an unterminated one, stays text. The content is the text outside the calls, null when there is at least
one call and nothing but blanks beside it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from specserve_types.api import InvalidRequestError
from specserve_types.protocol import GenerateArgs
from specserve_types.tools import (  # re-exported: the grammar, tool_choice and the answer's shapes live there
    ANY_OBJECT,
    CLOSE,
    OPEN,
    ResolvedTools,
    ToolCall,
    ToolOutput,
    call_schema,
    ends_in_calls,
    message_extra,
    resolve_tools,
    tool_call_constraint,
    tool_call_grammar,
)

__all__ = [
    "ANY_OBJECT", "CLOSE", "OPEN", "ParsedOutput", "ResolvedTools", "ToolCall", "ToolCallStream", "ToolOutput",
    "call_schema", "chat_prompt_ids", "ends_in_calls", "in_plain_words", "message_extra", "new_call_id",
    "parse_tool_calls", "read_call", "resolve_tools", "template_messages", "template_renders_tools",
    "tool_call_constraint", "tool_call_grammar",
]

# For templates that do not render tools: Qwen2.5's template's words about them, shortened (104 -> 59 SmolLM2
# tokens: a small model's context is short), the same format
TOOLS_PREAMBLE = "# Tools\n\nYou may call these functions:\n<tools>"
TOOLS_POSTAMBLE = ("\n</tools>\n\nTo call one, answer with:\n<tool_call>\n"
                   "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
DEFAULT_SYSTEM = "You are a helpful assistant."


# -- reading the output -------------------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_call(body: str) -> ToolCall | None:
    """The call a block's body holds, or None (the block is then text)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    elif isinstance(arguments, str):
        text = arguments
    else:
        return None
    return ToolCall(value["name"], text, new_call_id())


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    calls: tuple[ToolCall, ...]


def _blocks(text: str) -> Iterator[tuple[str, ToolCall | None]]:
    """The text cut into (piece, call): text outside blocks and blocks that are not calls with call None."""
    at = 0
    while True:
        start = text.find(OPEN, at)
        end = text.find(CLOSE, start + len(OPEN)) if start >= 0 else -1
        if end < 0:
            if at < len(text):
                yield text[at:], None
            return
        if start > at:
            yield text[at:start], None
        block_end = end + len(CLOSE)
        yield text[start:block_end], read_call(text[start + len(OPEN):end])
        at = block_end


def parse_tool_calls(text: str) -> ParsedOutput:
    """A whole output's calls and content (module docstring)."""
    content, calls = [], []
    for piece, call in _blocks(text):
        if call is None:
            content.append(piece)
        else:
            calls.append(call)
    joined = "".join(content)
    return ParsedOutput(None if calls and not joined.strip() else joined, tuple(calls))


class ToolCallStream:
    """An output read as it streams: `feed(delta)` and, at the end, `finish()` return events, ("content", text) or
    ("call", ToolCall), in order. Text that may begin a `<tool_call>` is held until it is known not to; a block
    until it closes; blanks before the first visible content until it comes (dropped when the output holds calls
    and no other content). The events' content joined is `parse_tool_calls`'s content ("" for None), their calls
    its calls, for every way of cutting the text."""

    def __init__(self) -> None:
        self._held = ""  # text not yet sent: blanks, a possible start of a block, or an open block
        self._blanks = ""  # blanks held before any visible content
        self._shown = False  # visible (non-blank) content was sent
        self.calls = 0

    def _content(self, text: str) -> list[tuple[str, Any]]:
        if not text:
            return []
        if not self._shown:
            if not text.strip():
                self._blanks += text
                return []
            text, self._blanks, self._shown = self._blanks + text, "", True
        return [("content", text)]

    def feed(self, delta: str) -> list[tuple[str, Any]]:
        self._held += delta
        events: list[tuple[str, Any]] = []
        while self._held:
            start = self._held.find(OPEN)
            if start < 0:  # no block: all but a possible start of one is content
                keep = next((n for n in range(min(len(OPEN) - 1, len(self._held)), 0, -1)
                             if self._held.endswith(OPEN[:n])), 0)
                events += self._content(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            events += self._content(self._held[:start])
            self._held = self._held[start:]
            end = self._held.find(CLOSE, len(OPEN))
            if end < 0:
                break  # an open block: held until it closes
            block_end = end + len(CLOSE)
            call = read_call(self._held[len(OPEN):end])
            if call is None:
                events += self._content(self._held[:block_end])
            else:
                self.calls += 1
                events.append(("call", call))
            self._held = self._held[block_end:]
        return events

    def finish(self) -> list[tuple[str, Any]]:
        """The rest: an unterminated block or a partial tag is text; blanks alone are content only without calls."""
        held, self._held = self._held, ""
        events = self._content(held)
        if not self._shown and not self.calls and self._blanks:
            events.append(("content", self._blanks))
        self._blanks = ""
        return events


# -- the prompt -----------------------------------------------------------------------------------------------
def _arguments(value: Any) -> Any:
    """An OpenAI call's arguments (JSON text) as the object chat templates expect (HF: `arguments | tojson`)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def template_messages(args: GenerateArgs) -> list[dict[str, Any]]:
    """The chat's messages as HF chat templates take them: role, content and each message's extras (an assistant's
    `tool_calls` with their arguments as objects, a tool result's `tool_call_id`)."""
    extras = args.message_extras or ("",) * len(args.messages)
    messages = []
    for (role, content), extra in zip(args.messages, extras, strict=True):
        message: dict[str, Any] = {"role": role, "content": content}
        if extra:
            message.update(json.loads(extra))
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": _arguments(call["function"].get("arguments"))}}
                for call in message["tool_calls"]]
        messages.append(message)
    return messages


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template shows the model a `tools` argument (Qwen2.5's does, SmolLM2's not)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments")
    return (f"{OPEN}\n{json.dumps({'name': function.get('name'), 'arguments': arguments}, ensure_ascii=False)}"
            f"\n{CLOSE}")


def in_plain_words(messages: list[dict[str, Any]], tools: list[Any] | None) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools, as Qwen2.5's renders them: the tools in the system message, an
    assistant's calls as `<tool_call>` blocks in its text, tool results as a user turn of `<tool_response>`s."""
    out: list[dict[str, Any]] = []
    if tools:
        listing = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else DEFAULT_SYSTEM
        out.append({"role": "system", "content": f"{system}\n\n{TOOLS_PREAMBLE}{listing}{TOOLS_POSTAMBLE}"})
        if messages and messages[0]["role"] == "system":
            messages = messages[1:]
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_call_text(call) for call in message["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("tool_results", None)
    return out


def chat_prompt_ids(tokenizer: Any, args: GenerateArgs) -> list[int]:
    """A chat request's prompt through the tokenizer's chat template, its tools and tool calls included;
    raises InvalidRequestError (`tools` or `messages`) when the template refuses them."""
    messages = template_messages(args)
    tools = json.loads(args.tools) if args.tools else None
    kwargs: dict[str, Any] = {}
    if template_renders_tools(tokenizer):
        if tools:
            kwargs["tools"] = tools
    elif tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        messages = in_plain_words(messages, tools)
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False, **kwargs))
    except (TypeError, ValueError, TemplateError, KeyError) as exc:
        field_name = "tools" if tools else "messages"
        raise InvalidRequestError(field_name, f"cannot be tokenized: {type(exc).__name__}: {exc}") from None
