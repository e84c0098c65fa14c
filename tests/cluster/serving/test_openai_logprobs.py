"""Log-probabilities at the OpenAI door (cluster/serving/openai_api.py, logprob_format.py), on chunks as the
scheduler sends them: the parameters (completions' logprobs N and echo, chat's logprobs and top_logprobs, vLLM's
prompt_logprobs, max_tokens 0 only with echo) and the answers' shapes, whole and streamed, field for field OpenAI's."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from cluster.serving.openai_api import Collected, SSEWriter, completion_body, parse_request
from cluster.serving.openai_models import ChatCompletionResponse, CompletionChunk, CompletionResponse
from specserve_types.api import InvalidRequestError, RowLogprobs, TokenChunk
from specserve_types.protocol import IndexedChunk, ServerDefaults

DEFAULTS = ServerDefaults("tiny", "ngram")
PIECES = {1: ("He", (72, 101)), 2: ("llo", (108, 108, 111)), 3: (" world", tuple(b" world")), 4: ("!", (33,)),
          5: ("\ufffd", (0xE4,)), 9: (" x", (32, 120))}


def rows(values: list[float], top: list[list[tuple[int, float]]]) -> RowLogprobs:
    width = len(top[0]) if top else 0
    return RowLogprobs(np.array(values, np.float32), np.array([[t for t, _ in r] for r in top], np.int32).reshape(
        len(values), width), np.array([[v for _, v in r] for r in top], np.float32).reshape(len(values), width),
        np.array([1] * len(values), np.int32))


def chunks(echo: bool = False, prompt_logprobs: bool = False) -> list[IndexedChunk]:
    """Prompt [1, 2] ("Hello"), then output [3] and [4, 5] in two chunks, two alternatives each."""
    first = TokenChunk("r", [3], " world", logprobs=rows([-0.5], [[(3, -0.5), (9, -1.25)]]),
                       prompt_logprobs=rows([-2.0], [[(9, -0.75), (2, -2.0)]]) if echo or prompt_logprobs else None)
    second = TokenChunk("r", [4, 5], "!", finish_reason="length", stats={"prompt_tokens": 2},
                        logprobs=rows([-0.125, -float("inf")], [[(4, -0.125), (9, -3.0)], [(9, -0.1), (4, -0.2)]]))
    return [IndexedChunk(0, first, "greedy", pieces=PIECES, prompt_token_ids=(1, 2) if echo or prompt_logprobs else (),
                         prompt_text="Hello" if echo else None),
            IndexedChunk(0, second, "greedy", pieces=PIECES)]


def answer(body: dict[str, Any], chat: bool, items: list[IndexedChunk]) -> dict[str, Any]:
    parsed = parse_request(body, DEFAULTS, chat=chat)
    collected = Collected(n=1)
    for item in items:
        collected.add(item)
    out = completion_body("r", "tiny", collected, chat, parsed.tools, parsed.view)
    (ChatCompletionResponse if chat else CompletionResponse).model_validate(out)
    return json.loads(json.dumps(out, allow_nan=False))  # JSON has no infinity


def test_parameters_become_the_sampling_fields() -> None:
    args = parse_request({"prompt": "x", "logprobs": 3, "echo": True}, DEFAULTS, chat=False).args
    assert (args.sampling.logprobs, args.sampling.prompt_logprobs, args.echo) == (3, 3, True)
    args = parse_request({"prompt": "x", "echo": True, "max_tokens": 0}, DEFAULTS, chat=False).args
    assert (args.sampling.logprobs, args.sampling.prompt_logprobs, args.sampling.max_tokens) == (None, 0, 0)
    args = parse_request({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 5,
                          "prompt_logprobs": 2, "logprobs_mode": "processed"}, DEFAULTS, chat=True).args
    assert (args.sampling.logprobs, args.sampling.prompt_logprobs, args.sampling.logprobs_mode) == (5, 2, "processed")
    assert parse_request({"prompt": "x"}, DEFAULTS, chat=False).args.sampling.logprobs is None


@pytest.mark.parametrize(("body", "chat", "field"), [
    ({"prompt": "x", "max_tokens": 0}, False, "max_tokens"),
    ({"prompt": "x", "logprobs": 21}, False, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, False, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": 21}, False, "prompt_logprobs"),
    ({"prompt": "x", "logprobs_mode": "logits"}, False, "logprobs_mode"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, True, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, True, "echo"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, True, "max_tokens"),
])
def test_bad_values_name_the_parameter(body: dict[str, Any], chat: bool, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(body, DEFAULTS, chat=chat)
    assert info.value.field == field


def test_completion_logprobs_with_echo() -> None:
    out = answer({"prompt": "Hello", "logprobs": 2, "echo": True}, False, chunks(echo=True))
    choice = out["choices"][0]
    assert choice["text"] == "Hello world!"
    assert choice["logprobs"] == {
        "tokens": ["He", "llo", " world", "!", "\ufffd"],
        "token_logprobs": [None, -2.0, -0.5, -0.125, -9999.0],
        "top_logprobs": [None, {" x": -0.75, "llo": -2.0}, {" world": -0.5, " x": -1.25}, {"!": -0.125, " x": -3.0},
                         {" x": -0.1, "!": -0.2, "\ufffd": -9999.0}],
        "text_offset": [0, 2, 5, 11, 12]}


def test_completion_logprobs_without_echo() -> None:
    choice = answer({"prompt": "Hello", "logprobs": 0}, False, chunks())["choices"][0]
    assert choice["text"] == " world!"
    assert choice["logprobs"]["tokens"] == [" world", "!", "\ufffd"]
    assert choice["logprobs"]["text_offset"] == [0, 6, 7]
    assert "prompt_logprobs" not in choice


def test_chat_logprobs_and_vllm_prompt_logprobs() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 2}
    choice = answer(body, True, chunks(prompt_logprobs=True))["choices"][0]
    content = choice["logprobs"]["content"]
    assert content[0] == {"token": " world", "logprob": -0.5, "bytes": list(b" world"), "top_logprobs": [
        {"token": " world", "logprob": -0.5, "bytes": list(b" world")}, {"token": " x", "logprob": -1.25,
                                                                          "bytes": [32, 120]}]}
    assert [c["token"] for c in content] == [" world", "!", "\ufffd"] and content[2]["bytes"] == [0xE4]
    assert choice["logprobs"]["refusal"] is None
    assert choice["prompt_logprobs"] == [None, {"2": {"logprob": -2.0, "rank": 1, "decoded_token": "llo"},
                                                "9": {"logprob": -0.75, "rank": 1, "decoded_token": " x"}}]


def test_no_logprobs_asked_none_shown() -> None:
    choice = answer({"messages": [{"role": "user", "content": "x"}]}, True, chunks())["choices"][0]
    assert choice["logprobs"] is None and "prompt_logprobs" not in choice


def sse(body: dict[str, Any], chat: bool, items: list[IndexedChunk]) -> list[dict[str, Any]]:
    parsed = parse_request(body, DEFAULTS, chat=chat)
    writer = SSEWriter("r", "tiny", chat, False, parsed.tools, parsed.view)
    events = [json.loads(e[len("data: "):]) for item in items for e in writer.events(item)]
    for event in events:
        if not chat:
            CompletionChunk.model_validate(event)
    return events


def test_streamed_completion_logprobs_add_up_to_the_whole() -> None:
    body = {"prompt": "Hello", "logprobs": 2, "echo": True, "stream": True}
    events = sse(body, False, chunks(echo=True))
    whole = answer({k: v for k, v in body.items() if k != "stream"}, False, chunks(echo=True))["choices"][0]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for e in events for x in e["choices"][0]["logprobs"][key]] == whole["logprobs"][key], key


def test_streamed_chat_logprobs() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1, "stream": True}
    events = sse(body, True, chunks())
    assert [t["token"] for e in events for t in e["choices"][0]["logprobs"]["content"]] == [" world", "!", "\ufffd"]
