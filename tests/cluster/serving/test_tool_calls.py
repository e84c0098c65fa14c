"""Tool calls (cluster/serving/tool_calls.py): reading an output into calls and content, whole and streamed (every
way of cutting it gives the same answer), the grammar of tool_choice "required" / a named function compiled by
llguidance on SmolLM2's tokenizer (a valid call accepted, bad arguments refused), and the prompt through a chat
template that renders tools (Qwen2.5's) and one that does not (SmolLM2's)."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from cluster.serving.tool_calls import (
    ToolCallStream,
    chat_prompt_ids,
    parse_tool_calls,
    template_renders_tools,
    tool_call_grammar,
)
from specserve_types.protocol import GenerateArgs

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
FUNCTIONS: list[tuple[str, dict[str, Any] | None]] = [("get_weather", WEATHER), ("get_time", TIME)]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'

OUTPUTS = [
    "",
    "plain text, no calls",
    "   \n ",
    CALL,
    f"{CALL}\n{CALL2}",
    f"Let me check.\n{CALL}",
    f"\n\n{CALL}\n\n{CALL2}\n",
    f"{CALL} and after",
    "a < b and <tool_ and <tool_call",  # partial tags are text
    "<tool_call>\n{not json}\n</tool_call> text",  # a block that is not a call stays text
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n["get_weather"]\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": 5}\n</tool_call>',
    '<tool_call>{"name": "f"}</tool_call>',  # no arguments: {}
    '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # arguments as JSON text: kept
    f"unterminated {CALL[:-3]}",
    f"<tool_call> <tool_call>{{\"name\": \"f\"}}</tool_call>{CALL}",  # a block holding a second open tag
    f"{CALL}</tool_call>",
    "héllo → ünïcode " + CALL.replace("Paris", "Zürich"),
]


def calls_of(parsed_calls: Any) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in parsed_calls]


def streamed(pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """What a client reassembles from the stream: the content deltas joined (None if nothing), the calls."""
    stream = ToolCallStream()
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    content = "".join(value for kind, value in events if kind == "content")
    calls = [(value.name, value.arguments) for kind, value in events if kind == "call"]
    assert all(value for kind, value in events if kind == "content")  # no empty content event
    return (content if content or not calls else None), calls


# -- reading the output ------------------------------------------------------------------------------------
def test_parsing_whole_outputs() -> None:
    parsed = parse_tool_calls(f"\n{CALL}\n{CALL2}\n")
    assert parsed.content is None
    assert calls_of(parsed.calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "UTC"}')]
    assert all(call.id.startswith("call_") and len(call.id) > 10 for call in parsed.calls)
    assert len({call.id for call in parsed.calls}) == 2
    assert parse_tool_calls(f"Let me check.\n{CALL}").content == "Let me check.\n"
    assert parse_tool_calls("no calls").content == "no calls" and parse_tool_calls("").content == ""
    assert parse_tool_calls("   ").content == "   "  # no calls: the text as it is
    not_json = "<tool_call>\n{not json}\n</tool_call> text"
    assert parse_tool_calls(not_json).content == not_json and not parse_tool_calls(not_json).calls
    assert calls_of(parse_tool_calls('<tool_call>{"name": "f"}</tool_call>').calls) == [("f", "{}")]
    assert calls_of(parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>').calls) \
        == [("f", '{"x": 1}')]
    unterminated = f"see {CALL[:-3]}"
    assert parse_tool_calls(unterminated).content == unterminated
    assert calls_of(parse_tool_calls(CALL.replace("Paris", "Zürich")).calls) == [("get_weather",
                                                                                  '{"city": "Zürich"}')]


@pytest.mark.parametrize("text", OUTPUTS)
def test_a_stream_cut_anywhere_reads_as_the_whole(text: str) -> None:
    whole = parse_tool_calls(text)
    expected = (whole.content, calls_of(whole.calls))
    assert streamed([text]) == expected
    assert streamed(list(text)) == expected  # a character at a time
    for cut in range(len(text) + 1):
        assert streamed([text[:cut], text[cut:]]) == expected, cut
    rng = random.Random(len(text))
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
        assert streamed(pieces) == expected, cuts


def test_a_stream_holds_a_possible_tag_and_sends_plain_text_at_once() -> None:
    stream = ToolCallStream()
    assert stream.feed("Hello <to") == [("content", "Hello ")]
    assert stream.feed("ol") == []
    assert stream.feed("s are fun") == [("content", "<tools are fun")]
    assert stream.feed(" <tool_call>\n{\"name\": \"f\", ") == [("content", " ")]
    assert stream.feed('"arguments": {}}\n</tool_call') == []
    (kind, call), = stream.feed(">")
    assert kind == "call" and (call.name, call.arguments) == ("f", "{}") and stream.calls == 1
    assert stream.finish() == []


# -- the grammar -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizers(smollm2_dir: Path) -> tuple[Any, Any]:
    import llguidance.hf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


def matches(tokenizers: tuple[Any, Any], grammar: str, text: str) -> bool:
    """Whether llguidance takes `text` (as the tokenizer cuts it) and may end there."""
    import llguidance

    tokenizer, ll_tokenizer = tokenizers
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_the_required_grammar_takes_calls_whose_arguments_match(tokenizers: tuple[Any, Any]) -> None:
    grammar = tool_call_grammar(FUNCTIONS, parallel=True)
    assert matches(tokenizers, grammar, CALL)
    assert matches(tokenizers, grammar, '<tool_call>\n{"name":"get_weather","arguments":{"city":"P","days":3}}'
                                        '\n</tool_call>')
    assert matches(tokenizers, grammar, f"{CALL}\n{CALL2}\n{CALL}")  # parallel calls
    assert matches(tokenizers, grammar, CALL2)
    for bad in (CALL.replace('"Paris"', "5"),  # a string argument as a number
                CALL.replace('"city": "Paris"', '"town": "Paris"'),  # an unknown argument, city missing
                CALL.replace('"Paris"}', '"Paris", "days": 0}'),  # below the minimum
                CALL2.replace("UTC", "PST"),  # not in the enum
                CALL.replace("get_weather", "get_wetter"),  # no such function
                CALL.replace('"name": "get_weather", ', ""),  # no name
                "Sure! " + CALL,  # text before the call
                CALL[:-3],  # unfinished
                f"{CALL}\n",
                ""):
        assert not matches(tokenizers, grammar, bad), bad


def test_one_call_without_parallel_calls_and_a_named_function(tokenizers: tuple[Any, Any]) -> None:
    single = tool_call_grammar(FUNCTIONS, parallel=False)
    assert matches(tokenizers, single, CALL) and not matches(tokenizers, single, f"{CALL}\n{CALL2}")
    named = tool_call_grammar([FUNCTIONS[1]], parallel=True)
    assert matches(tokenizers, named, CALL2) and not matches(tokenizers, named, CALL)


def test_a_grammar_with_refs_and_no_parameters(tokenizers: tuple[Any, Any]) -> None:
    """pydantic's schemas refer to their own `$defs`: they still resolve inside the call's schema."""
    nested = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
              "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"], "additionalProperties": False}}}
    grammar = tool_call_grammar([("locate", nested), ("ping", None)])
    assert matches(tokenizers, grammar, '<tool_call>\n{"name": "locate", "arguments": {"where": {"city": "Oslo"}}}'
                                        '\n</tool_call>')
    assert not matches(tokenizers, grammar, '<tool_call>\n{"name": "locate", "arguments": {"where": {"town": "O"}}}'
                                            '\n</tool_call>')
    assert matches(tokenizers, grammar, '<tool_call>\n{"name": "ping", "arguments": {"any": [1]}}\n</tool_call>')


def test_tools_with_a_json_answer(tokenizers: tuple[Any, Any]) -> None:
    """tool_choice "auto" with a JSON response_format: calls, or an answer in the format."""
    answer = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    grammar = tool_call_grammar(FUNCTIONS, parallel=True, answer_schema=answer)
    assert matches(tokenizers, grammar, CALL) and matches(tokenizers, grammar, '{"ok": true}')
    assert not matches(tokenizers, grammar, '{"ok": 1}') and not matches(tokenizers, grammar, "text")


# -- the prompt --------------------------------------------------------------------------------------------
# Qwen2.5's chat template (Qwen/Qwen2.5-Coder-1.5B-Instruct's tokenizer_config.json), which renders tools
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}}]
CALLED = {"tool_calls": [{"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
HISTORY = GenerateArgs(
    request_id="r", chat=True, tools=json.dumps(TOOLS),
    messages=(("user", "Weather in Paris?"), ("assistant", ""), ("tool", "sunny, 21 C"), ("tool", "no rain")),
    message_extras=("", json.dumps(CALLED), json.dumps({"tool_call_id": "call_1"}),
                    json.dumps({"tool_call_id": "call_1"})))


def test_a_template_that_renders_tools_gets_them(tokenizers: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = tokenizers[0]
    monkeypatch.setattr(tokenizer, "chat_template", QWEN25_TEMPLATE)
    assert template_renders_tools(tokenizer)
    prompt = tokenizer.decode(chat_prompt_ids(tokenizer, HISTORY))
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt and "Weather of a city" in prompt
    # the call's arguments reach the template as an object (`tojson` of the JSON text would quote it)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\nno rain\n" \
           "</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_them_in_qwens_words(tokenizers: tuple[Any, Any]) -> None:
    tokenizer = tokenizers[0]
    assert not template_renders_tools(tokenizer)  # SmolLM2's
    prompt = tokenizer.decode(chat_prompt_ids(tokenizer, HISTORY))
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n")
    assert json.dumps(TOOLS[0]) in prompt and "answer with:\n<tool_call>\n{\"name\": <function-name>" in prompt
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           "</tool_call><|im_end|>" in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\nno rain\n" \
           "</tool_response><|im_end|>" in prompt
    plain = GenerateArgs(request_id="r", chat=True, messages=(("system", "Be brief."), ("user", "hi")))
    assert tokenizer.decode(chat_prompt_ids(tokenizer, plain)) == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], add_generation_prompt=True,
        tokenize=False)
    system_and_tools = GenerateArgs(request_id="r", chat=True, messages=(("system", "Be brief."), ("user", "hi")),
                                    tools=json.dumps(TOOLS))
    prompt = tokenizer.decode(chat_prompt_ids(tokenizer, system_and_tools))
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and prompt.count("<|im_start|>system") == 1
