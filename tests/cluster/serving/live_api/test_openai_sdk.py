"""The OpenAI HTTP API as the official `openai` SDK sees it, against the live cluster (live_api/conftest.py):
every route sync and async, streamed and not, n > 1, stop strings, include_usage, refused parameters raising
the SDK's BadRequestError, and a stream the client abandons (aborted at the scheduler, no KV leaked).
(Unpaired surrogates cannot be sent through the SDK, which refuses to encode them: live_api/test_http_fuzz.py
sends them as raw JSON.)
Greedy outputs (the default) let streamed, non-streamed, sync and async answers be compared exactly.
Run inside the loopback-only namespace (scripts/in-netns.sh).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cluster.serving.config import ClusterConfig
from tests.cluster.serving.live_api.helpers import BASE_URL, assert_no_leaks, scheduler_call, wait_aborted

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m"
PROMPT = "def fibonacci(n):"
PROMPT_IDS = [1, 563, 24905, 30, 94, 2423]  # any in-vocabulary ids: the prompt is counted, not read
MESSAGES: list[Any] = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 12
FIXED_LENGTH = {"ignore_eos": True}  # specserve extension: exactly max_tokens tokens


@pytest.fixture(scope="module")
def sdk(cluster: ClusterConfig) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{BASE_URL}/v1", api_key="any", max_retries=0, timeout=120) as client:
        yield client


def async_sdk() -> AsyncOpenAI:
    """One per event loop (its connections belong to the loop that opened them)."""
    return AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key="any", max_retries=0, timeout=120)


def token_ids(item: Any) -> list[int]:
    """specserve's extension of a choice / chunk, which the SDK keeps as an extra field."""
    return list(item.model_extra["token_ids"])


def stop_string(text: str, length: int) -> str:
    """A piece of `text` from its second half, not only blanks (the output is cut where it first occurs)."""
    start = next((i for i in range(len(text) // 2, len(text) - length + 1) if text[i:i + length].strip()), None)
    assert start is not None, f"{text!r} has no stop string to cut at"
    return text[start:start + length]


# -- models ------------------------------------------------------------------------------------------------
def test_models(sdk: OpenAI) -> None:
    models = list(sdk.models.list())
    assert [m.id for m in models] == [MODEL]
    assert isinstance(models[0], Model) and models[0].object == "model" and models[0].owned_by == "specserve"


# -- completions ---------------------------------------------------------------------------------------------
def test_completion_streamed_and_not(sdk: OpenAI) -> None:
    whole = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body=FIXED_LENGTH)
    assert isinstance(whole, Completion) and whole.object == "text_completion" and whole.model == MODEL
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and choice.text and choice.index == 0
    assert whole.usage is not None and whole.usage.completion_tokens == len(token_ids(choice)) == MAX_TOKENS
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + MAX_TOKENS and whole.usage.prompt_tokens > 0

    chunks = list(sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
                                         extra_body=FIXED_LENGTH))
    assert all(isinstance(c, Completion) and c.id == chunks[0].id for c in chunks) and len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)


def test_completion_usage_counts_the_tokens(sdk: OpenAI) -> None:
    whole = sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=5, extra_body=FIXED_LENGTH)
    assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        len(PROMPT_IDS), 5)

    chunks = list(sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=5, stream=True, n=2,
                                         stream_options={"include_usage": True}, extra_body=FIXED_LENGTH))
    *content, last = chunks
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        len(PROMPT_IDS), 10, len(PROMPT_IDS) + 10)
    assert all(c.usage is None and len(c.choices) == 1 for c in content)
    streamed = sum(len(c.model_extra["specserve"]["token_ids"]) for c in content)
    assert streamed == last.usage.completion_tokens
    assert sorted({c.choices[0].index for c in content}) == [0, 1]


def test_n_completions_and_stop_strings(sdk: OpenAI) -> None:
    reference = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body=FIXED_LENGTH)
    text = reference.choices[0].text
    three = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, n=3, extra_body=FIXED_LENGTH)
    assert [c.index for c in three.choices] == [0, 1, 2] and {c.text for c in three.choices} == {text}
    assert three.usage is not None and three.usage.completion_tokens == 3 * MAX_TOKENS
    stop = stop_string(text, 3)
    cut = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stop=[stop, "\x00never"],
                                 extra_body=FIXED_LENGTH)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]


# -- chat ------------------------------------------------------------------------------------------------------
def test_chat_streamed_and_not(sdk: OpenAI) -> None:
    whole = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, n=2)
    assert isinstance(whole, ChatCompletion) and whole.object == "chat.completion"
    assert [c.index for c in whole.choices] == [0, 1]
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content and message.content == whole.choices[1].message.content
    assert whole.usage is not None and whole.usage.prompt_tokens > 0

    chunks = list(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=MAX_TOKENS,
                                              stream=True, stream_options={"include_usage": True}))
    *content, last = chunks
    assert all(isinstance(c, ChatCompletionChunk) and c.object == "chat.completion.chunk" for c in chunks)
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == message.content
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens // 2


def test_chat_stop_string(sdk: OpenAI) -> None:
    text = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                       extra_body=FIXED_LENGTH).choices[0].message.content or ""
    stop = stop_string(text, 2)
    cut = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, stop=stop,
                                      extra_body=FIXED_LENGTH)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.index(stop)]


# -- async ------------------------------------------------------------------------------------------------------
def test_async_client_answers_the_same(sdk: OpenAI) -> None:
    completion = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS).choices[0].text
    chat = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS).choices[0].message.content

    async def run() -> tuple[Any, ...]:
        async with async_sdk() as client:
            async def streamed_completion() -> str:
                stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True)
                return "".join([c.choices[0].text async for c in stream])

            async def streamed_chat() -> tuple[str, Any]:
                stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                              stream=True, stream_options={"include_usage": True})
                chunks = [c async for c in stream]
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage

            answers = await asyncio.gather(
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS),
                client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS),
                streamed_completion(), streamed_chat())
            return (*answers, await client.models.list())

    plain, plain_chat, streamed, (streamed_chat_text, usage), models = asyncio.run(run())
    assert isinstance(plain, Completion) and plain.choices[0].text == completion == streamed
    assert isinstance(plain_chat, ChatCompletion) and plain_chat.choices[0].message.content == chat == streamed_chat_text
    assert usage is not None and usage.completion_tokens == plain_chat.usage.completion_tokens
    assert [m.id for m in models.data] == [MODEL]


def test_async_bad_request_raises_the_typed_error(sdk: OpenAI) -> None:
    async def run() -> openai.BadRequestError:
        async with async_sdk() as client:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model=MODEL, messages=MESSAGES, tool_choice="required")
            return info.value

    error = asyncio.run(run())
    assert error.status_code == 400 and error.param == "tool_choice" and error.type == "invalid_request_error"


# -- refusals ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("chat", "kwargs", "param"),
    [
        (False, {"max_tokens": -1}, "max_tokens"),
        (False, {"top_p": 5}, "top_p"),
        (False, {"best_of": 2}, "best_of"),
        (False, {"logprobs": 21}, "logprobs"),
        (False, {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        (False, {"suffix": "}"}, "suffix"),
        (False, {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        (False, {"model": "gpt-4o"}, "model"),
        (True, {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format.json_schema.name"),
        (True, {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frob"}}}},
         "response_format"),  # the engine does not compile it
        (True, {"tools": [{"type": "function", "function": {"name": "f f"}}]}, "tools[0].function.name"),
        (True, {"tool_choice": "required"}, "tool_choice"),  # without tools
        (True, {"functions": [{"name": "f"}]}, "functions"),
        (True, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        (True, {"logit_bias": {"50": 101}}, "logit_bias"),
        (True, {"logit_bias": {"4000000": 1}}, "logit_bias"),  # outside the vocabulary: the engine's refusal
        (True, {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        (True, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_refused_and_bad_parameters_raise_bad_request(sdk: OpenAI, chat: bool, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if chat:
            sdk.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **kwargs})
        else:
            sdk.completions.create(**{"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **kwargs})
    assert info.value.status_code == 400 and info.value.param == param, info.value.message
    assert info.value.type == "invalid_request_error" and info.value.body["message"].startswith(f"{param}: ")
    assert info.value.response.headers["x-specserve-request-id"].startswith("req-")


# -- a client that leaves ----------------------------------------------------------------------------------------
def test_a_closed_stream_aborts_the_request(sdk: OpenAI) -> None:
    aborted = scheduler_call("stats")["scheduler"]["aborted"]
    stream = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, stream=True,
                                    extra_body={"ignore_eos": True, "k": 0})
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    stream.close()  # the SDK closes the response: the server sees the client leave
    wait_aborted(aborted + 1)
    assert_no_leaks()


def test_nothing_leaked(cluster: ClusterConfig) -> None:
    assert_no_leaks()
