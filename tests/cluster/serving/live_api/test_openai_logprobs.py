"""Log-probabilities through the live cluster (live_api/conftest.py: SmolLM2 drafting for itself, bf16),
as the official `openai` SDK and the gRPC client read them:

- completions' `logprobs` N and chat's `logprobs` / `top_logprobs`, whole and streamed (the same figures);
- greedy speculation's figures equal plain decoding's (k 0) bit for bit, and a prompt scored with `echo` and
  `max_tokens` 0 gives its continuation's tokens the same figures as generating them (float32 bits);
- gRPC's chunks carry the same figures as HTTP's; vLLM's `prompt_logprobs`; nothing leaked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from openai import OpenAI

from cluster.client import SpecServeClient, collect
from cluster.serving.config import ClusterConfig
from tests.cluster.serving.live_api.helpers import BASE_URL, assert_no_leaks

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m"
PROMPT = "The three primary colours are"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def sdk(cluster: ClusterConfig) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{BASE_URL}/v1", api_key="any", max_retries=0, timeout=120) as client:
        yield client


def f32(values: list[Any]) -> np.ndarray:
    return np.array(values, np.float64).astype(np.float32)


def completion(sdk: OpenAI, stream: bool = False, **kwargs: Any) -> tuple[str, dict[str, list[Any]]]:
    """The choice's text and logprobs (a stream's joined)."""
    extra = kwargs.pop("extra_body", {})
    call = dict(model=MODEL, prompt=kwargs.pop("prompt", PROMPT), max_tokens=kwargs.pop("max_tokens", MAX_TOKENS),
                extra_body={"ignore_eos": True, **extra}, **kwargs)
    if not stream:
        choice = sdk.completions.create(**call).choices[0]
        assert choice.logprobs is not None
        return choice.text, choice.logprobs.model_dump()
    text, joined = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in sdk.completions.create(stream=True, **call):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            for key in joined:
                joined[key] += getattr(chunk.choices[0].logprobs, key) or []
    return text, joined


def test_completion_logprobs_whole_and_streamed(sdk: OpenAI) -> None:
    text, whole = completion(sdk, logprobs=3)
    streamed_text, streamed = completion(sdk, stream=True, logprobs=3)
    assert streamed_text == text and streamed == whole
    assert len(whole["tokens"]) == MAX_TOKENS and "".join(whole["tokens"]) == text
    for token, logprob, top in zip(whole["tokens"], whole["token_logprobs"], whole["top_logprobs"], strict=True):
        assert logprob <= 0 and top[token] == logprob and max(top.values()) == logprob  # greedy: the likeliest
        assert len(top) == 3


def test_greedy_speculation_reports_plain_decodings_bits(sdk: OpenAI) -> None:
    _, spec = completion(sdk, logprobs=5, extra_body={"k": 4})
    _, plain = completion(sdk, logprobs=5, extra_body={"k": 0})
    assert spec["tokens"] == plain["tokens"]
    np.testing.assert_array_equal(f32(spec["token_logprobs"]).view(np.int32), f32(plain["token_logprobs"]).view(np.int32))
    assert spec["top_logprobs"] == plain["top_logprobs"]


def test_echo_scores_the_prompt_as_generation_does(sdk: OpenAI) -> None:
    text, generated = completion(sdk, logprobs=1)
    scored_text, scored = completion(sdk, prompt=PROMPT + text, logprobs=1, echo=True, max_tokens=0)
    assert scored_text == PROMPT + text
    assert scored["token_logprobs"][0] is None and scored["top_logprobs"][0] is None
    assert scored["tokens"][-MAX_TOKENS:] == generated["tokens"]
    np.testing.assert_array_equal(f32(scored["token_logprobs"][-MAX_TOKENS:]).view(np.int32),
                                  f32(generated["token_logprobs"]).view(np.int32))  # a prefill's rows are the steps'

    assert scored["text_offset"][0] == 0 and scored["text_offset"][-MAX_TOKENS] == len(PROMPT)


def test_chat_logprobs_whole_and_streamed(sdk: OpenAI) -> None:
    call = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=MAX_TOKENS,
                logprobs=True, top_logprobs=2)
    choice = sdk.chat.completions.create(**call).choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == MAX_TOKENS or choice.finish_reason == "stop"
    for entry in content:
        assert entry.bytes is not None and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == entry.logprob and entry.top_logprobs[0].token == entry.token
    streamed = [e for chunk in sdk.chat.completions.create(stream=True, **call)
                if chunk.choices and chunk.choices[0].logprobs is not None
                for e in chunk.choices[0].logprobs.content or []]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


def test_vllm_prompt_logprobs(sdk: OpenAI) -> None:
    choice = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 1})
    entries = choice.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) > 2
    assert all(1 <= len(e) <= 2 and all("rank" in v and "decoded_token" in v for v in e.values()) for e in entries[1:])


def test_grpc_reports_the_same_figures(sdk: OpenAI, client: SpecServeClient) -> None:
    _, http = completion(sdk, logprobs=2, echo=True)
    (sample,) = collect(client.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2,
                                        echo=True)).values()
    rows, prompt = sample["logprobs"], sample["prompt_logprobs"]
    assert rows is not None and prompt is not None and sample["prompt_text"] == PROMPT
    np.testing.assert_array_equal(np.concatenate([prompt.token_logprobs, rows.token_logprobs]),
                                  f32(http["token_logprobs"][1:]))
    assert [sample["pieces"][t][0] for t in sample["token_ids"]] == http["tokens"][-MAX_TOKENS:]


def test_nothing_leaked(cluster: ClusterConfig) -> None:
    assert_no_leaks()
