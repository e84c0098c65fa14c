"""Constrained decoding through the OpenAI HTTP API of the live cluster (live_api/conftest.py), with the official
`openai` SDK and the real engine: `chat.completions.parse` with a pydantic model returns a parsed object;
`tools` with tool_choice "required" (and a named function) return tool_calls whose arguments validate against the
function's schema, streamed as the non-streamed answer and with n = 2; vLLM's structured_outputs and guided_*
through `extra_body`; logit_bias; a constraint the engine cannot compile is a 400 naming its field; then no KV is
leaked and no request failed inside the scheduler. SmolLM2's template renders no tools: specserve writes them into
its system message (cluster/serving/tool_calls.py). Run inside the loopback-only namespace (scripts/in-netns.sh).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from cluster.serving.config import ClusterConfig
from tests.cluster.serving.live_api.helpers import BASE_URL, assert_no_leaks, scheduler_call

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m"
MAX_TOKENS = 96


class Colour(BaseModel):
    name: Literal["red", "green", "blue"]
    shade: int = Field(ge=1, le=9)


class Palette(BaseModel):
    colours: list[Colour] = Field(max_length=3)
    warm: bool


# small, as the cluster's context is (256 tokens): the prompt with both tools is 211 tokens on SmolLM2
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
                    {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
KNOWN_FAILURES: list[int] = []  # requests that failed in the engine for a known reason (xfail below)
CALL_TOKENS = 44  # max_tokens of a tools request (prompt ~211 tokens): one call is ~30 tokens
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def sdk(cluster: ClusterConfig) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{BASE_URL}/v1", api_key="any", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def errored_before(cluster: ClusterConfig) -> int:
    return int(scheduler_call("stats")["scheduler"]["errored"])


def assert_calls(calls: list[Any] | None, names: frozenset[str] = frozenset(SCHEMAS)) -> None:
    """Tool calls of functions in `names` whose arguments validate against their function's parameters."""
    assert calls, calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- structured output ------------------------------------------------------------------------------------------
def test_parse_returns_the_pydantic_object(sdk: OpenAI, errored_before: int) -> None:
    messages: list[Any] = [{"role": "user", "content": "Give me a warm palette as JSON."}]
    completion = sdk.chat.completions.parse(model=MODEL, messages=messages, response_format=Palette,
                                            max_tokens=MAX_TOKENS)
    (choice,) = completion.choices
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Palette), choice.message
    assert Palette.model_validate_json(choice.message.content or "") == choice.message.parsed
    sampled = sdk.chat.completions.parse(model=MODEL, messages=messages, response_format=Palette, n=2, seed=5,
                                         temperature=1.0, max_tokens=MAX_TOKENS)
    assert [c.index for c in sampled.choices] == [0, 1]
    assert all(isinstance(c.message.parsed, Palette) for c in sampled.choices if c.finish_reason == "stop")


def test_json_object_streamed_equals_the_whole(sdk: OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Describe a cat as a JSON object."}]
    kwargs: dict[str, Any] = {"model": MODEL, "messages": messages, "response_format": {"type": "json_object"},
                              "max_tokens": 48}
    whole = sdk.chat.completions.create(**kwargs)
    text = whole.choices[0].message.content or ""
    if whole.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")
    streamed = list(sdk.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize("chat", [True, False])
def test_structured_outputs_and_guided_fields(sdk: OpenAI, chat: bool) -> None:
    def ask(extra: dict[str, Any], **kwargs: Any) -> list[Any]:
        if chat:
            answer = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is it sunny?"}],
                                                 max_tokens=12, extra_body=extra, **kwargs)
            return [(c.message.content, c.finish_reason) for c in answer.choices]
        done = sdk.completions.create(model=MODEL, prompt="Is it sunny? Answer:", max_tokens=12, extra_body=extra,
                                      **kwargs)
        return [(c.text, c.finish_reason) for c in done.choices]

    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
        answers = ask(extra, n=2, temperature=1.0, seed=1)
        assert len(answers) == 2 and all(text in ("yes", "no") and finish == "stop" for text, finish in answers), \
            answers
    for extra in ({"structured_outputs": {"regex": "[0-9]{2}-[a-z]{2}"}}, {"guided_regex": "[0-9]{2}-[a-z]{2}"}):
        ((text, finish),) = ask(extra)
        assert re.fullmatch("[0-9]{2}-[a-z]{2}", text or "") and finish == "stop", text
    ((text, finish),) = ask({"guided_grammar": 'start: "It is " ("sunny" | "raining") "."'})
    assert text in ("It is sunny.", "It is raining.") and finish == "stop"
    ((text, finish),) = ask({"structured_outputs": {"json": {"type": "integer", "minimum": 1, "maximum": 5}}})
    assert 1 <= json.loads(text or "") <= 5 and finish == "stop"


def test_logit_bias_bans_a_token(sdk: OpenAI) -> None:
    free = sdk.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=4, extra_body={"k": 0})
    token = free.choices[0].model_extra["token_ids"][0]  # type: ignore[index]
    banned = sdk.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=4,
                                    logit_bias={str(token): -100})
    assert token not in banned.choices[0].model_extra["token_ids"]  # type: ignore[index]


# -- tools -------------------------------------------------------------------------------------------------------
def test_tool_choice_required_returns_calls_matching_the_schema(sdk: OpenAI) -> None:
    """One call (parallel_tool_calls false): the grammar completes after it, so the output ends there."""
    answer = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=CALL_TOKENS)
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls", choice
    assert_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls or []) == 1 and choice.message.content is None


def test_parallel_calls(sdk: OpenAI) -> None:
    """Calls may follow calls (SmolLM2 goes on calling until max_tokens: the last, cut, block stays text)."""
    (choice,) = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=CALL_TOKENS).choices
    assert_calls(choice.message.tool_calls)
    if choice.finish_reason == "length":
        assert (choice.message.content or "").strip().startswith("<tool_call>"), choice
    else:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice


def test_a_named_function(sdk: OpenAI) -> None:
    answer = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=CALL_TOKENS,
                                         parallel_tool_calls=False,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}})
    (choice,) = answer.choices
    assert choice.finish_reason == "stop", choice  # as OpenAI answers a named tool_choice
    assert_calls(choice.message.tool_calls, names=frozenset({"get_time"}))


def test_tool_calls_streamed_equal_the_whole(sdk: OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                              "parallel_tool_calls": False, "max_tokens": CALL_TOKENS}
    whole = sdk.chat.completions.create(**kwargs).choices[0]
    calls: list[dict[str, str]] = []
    finish = None
    for chunk in sdk.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index == len(calls) and delta.function is not None
                    calls.append({"name": delta.function.name or "", "arguments": delta.function.arguments or ""})
                else:
                    assert delta.function is not None
                    calls[delta.index]["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in whole.message.tool_calls or []]


def test_n2_each_choice_calls(sdk: OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "n": 2,
                              "parallel_tool_calls": False, "temperature": 0.8, "seed": 11, "max_tokens": CALL_TOKENS}
    answer = sdk.chat.completions.create(**kwargs)
    assert [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert_calls(choice.message.tool_calls)
    streamed: dict[int, list[str]] = {0: [], 1: []}
    finishes: dict[int, str] = {}
    for chunk in sdk.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += [d.function.name for d in choice.delta.tool_calls or []
                                       if d.id is not None and d.function is not None and d.function.name]
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    assert streamed == {c.index: [call.function.name for call in c.message.tool_calls or []]
                        for c in answer.choices}  # seeded: the same samples


def test_auto_and_a_tool_calling_history(sdk: OpenAI) -> None:
    """auto: text or calls, read back either way; a history with a call and its result is taken."""
    auto = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=32).choices[0]
    assert auto.finish_reason in ("stop", "length", "tool_calls")
    assert auto.message.content is not None or auto.message.tool_calls
    history: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    after = sdk.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                        max_tokens=16).choices[0]
    assert after.message.content and after.message.tool_calls is None


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
         "response_format"),
        ({"extra_body": {"guided_grammar": 'start: "a" b'}}, "guided_grammar"),
        ({"extra_body": {"structured_outputs": {"regex": "("}}}, "structured_outputs.regex"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ],
)
def test_what_the_engine_cannot_take_is_400_naming_the_field(sdk: OpenAI, kwargs: dict[str, Any],
                                                             param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kwargs)
    assert info.value.status_code == 400 and info.value.param == param, info.value.message


def test_a_choice_the_vocabulary_cannot_spell(sdk: OpenAI) -> None:
    """SmolLM2's tokenizer has no token for "\x1d": after "\x89" the choice cannot go on. A 400 or an answer that
    ends, never a failed round (the fuzzer's find)."""
    errored = scheduler_call("stats")["scheduler"]["errored"]
    try:
        answer = sdk.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                        extra_body={"guided_choice": ["\x89\x1d", "\U000181e6\x12"]})
        assert answer.choices[0].finish_reason in ("stop", "length"), answer.choices[0]
    except openai.BadRequestError as error:
        assert error.param == "guided_choice"
    finally:
        failed = scheduler_call("stats")["scheduler"]["errored"] - errored
        KNOWN_FAILURES.append(failed)
    assert failed == 0


def test_nothing_leaked_and_nothing_failed(cluster: ClusterConfig, errored_before: int) -> None:
    assert_no_leaks()
    known = sum(KNOWN_FAILURES)  # test_a_choice_the_vocabulary_cannot_spell's, until the engine ends it itself
    assert scheduler_call("stats")["scheduler"]["errored"] - errored_before == known
