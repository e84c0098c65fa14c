"""The gRPC messages (generated code on this protobuf runtime) and request validation of both front ends."""

from __future__ import annotations

import json

import google.protobuf
import pytest

from cluster.client import build_request
from cluster.serving.openai_api import Collected, completion_body, parse_chat, parse_completion, sse_event
from specserve_types.api import MAX_TOKENS_LIMIT, InvalidRequestError, TokenChunk
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.protocol import (
    IndexedChunk,
    ServerDefaults,
    args_from_proto,
    chunk_from_proto,
    chunk_to_proto,
)

DEFAULTS = ServerDefaults("smollm2-135m", draft="ngram")


def test_generated_code_matches_the_runtime() -> None:
    assert google.protobuf.__version__.startswith("7.")
    service = pb.DESCRIPTOR.services_by_name["SpecServe"]
    assert [m.name for m in service.methods] == ["Generate", "ListModels", "Health", "GetStats"]
    assert service.methods_by_name["Generate"].server_streaming
    assert pb.DESCRIPTOR.package == "specserve.v1"


def test_request_round_trip_keeps_unset_optionals_unset() -> None:
    request = build_request("def f(x):", max_tokens=7, top_p=0.5, stop=["\n\n"], contract="exact", k=3, n=2,
                            seed=11, temperature=0.8)
    wire = pb.GenerateRequest.FromString(request.SerializeToString())
    assert wire == request and wire.WhichOneof("prompt") == "text"
    assert wire.HasField("k") and wire.k == 3 and not wire.HasField("min_p")
    args = args_from_proto(wire, DEFAULTS)
    assert args.prompt_text == "def f(x):" and args.n == 2 and args.completion_ids()[1].endswith("#1")
    assert (args.sampling.max_tokens, args.sampling.top_p, args.sampling.stop, args.sampling.seed) == (7, 0.5, ("\n\n",), 11)
    assert (args.spec.contract, args.spec.k, args.spec.draft) == ("exact", 3, "ngram")


def test_unset_fields_take_server_defaults() -> None:
    args = args_from_proto(build_request([1, 2, 3]), DEFAULTS)
    assert args.prompt_token_ids == (1, 2, 3)
    assert (args.spec.k, args.spec.contract, args.spec.draft) == (None, "greedy", "ngram")  # k unset = auto
    assert args.sampling.max_tokens is None and args.sampling.top_p == 1.0  # unset: until the model ends the answer
    sampled = args_from_proto(build_request("x", temperature=0.7), ServerDefaults("m"))
    assert (sampled.spec.contract, sampled.spec.draft) == ("exact", "model")


def test_chunk_round_trip() -> None:
    chunk = TokenChunk("req-1", [5, 6, 7], "abc", proposed=4, accepted=2, finish_reason="length",
                       stats={"rounds": 3, "acceptance": {"accepted_len_histogram": [1, 0, 2]}})
    message = chunk_to_proto(IndexedChunk(1, chunk, "greedy"))
    back = chunk_from_proto(pb.GenerateChunk.FromString(message.SerializeToString()))
    assert back == IndexedChunk(1, chunk, "greedy")
    assert json.loads(message.stats_json)["rounds"] == 3
    partial = chunk_to_proto(IndexedChunk(0, TokenChunk("r", [1], "a"), "exact"))
    assert partial.finish_reason == "" and partial.stats_json == ""
    assert chunk_from_proto(partial).chunk.finish_reason is None


@pytest.mark.parametrize(
    ("fields", "prompt", "field"),
    [
        ({}, "", "prompt"),
        ({}, None, "prompt"),
        ({}, [], "prompt"),
        ({"max_tokens": -1}, "x", "max_tokens"),
        ({"max_tokens": 0}, "x", "max_tokens"),
        ({"max_tokens": MAX_TOKENS_LIMIT + 1}, "x", "max_tokens"),
        ({"max_tokens": 2**31 - 1}, "x", "max_tokens"),
        ({"top_p": 0.0}, "x", "top_p"),
        ({"top_p": 1.5}, "x", "top_p"),
        ({"temperature": -1.0}, "x", "temperature"),
        ({"model": "gpt-4"}, "x", "model"),
        ({"contract": "bogus"}, "x", "contract"),
        ({"k": 9}, "x", "k"),
        ({"k": -1}, "x", "k"),
        ({"draft": "bogus"}, "x", "draft"),
        ({"n": 0}, "x", "n"),
        ({"stop": [""]}, "x", "stop"),
        ({"chat": True}, None, "messages"),
        ({"chat": True, "messages": [("robot", "hi")]}, None, "messages[0].role"),
        ({"messages": [("user", "hi")]}, None, "messages"),
    ],
)
def test_grpc_bad_input_names_the_field(fields: dict, prompt: object, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        args_from_proto(build_request(prompt, **fields), DEFAULTS)
    assert info.value.field == field


def test_chat_text_becomes_the_user_message() -> None:
    args = args_from_proto(build_request("hello", chat=True, messages=[("system", "be brief")]), DEFAULTS)
    assert args.chat and args.messages == (("system", "be brief"), ("user", "hello")) and args.prompt_text is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_p": 2}, "top_p"),
        ({"prompt": "x", "model": "gpt-4"}, "model"),
        ({"prompt": "x", "contract": "nope"}, "contract"),
        ({"prompt": "x", "k": "many"}, "k"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "temperature": True}, "temperature"),
    ],
)
def test_openai_completion_bad_input_names_the_field(body: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_completion(body, DEFAULTS)
    assert info.value.field == field


def test_openai_parsing() -> None:
    args = parse_completion({"prompt": [[4, 5, 6]], "max_tokens": 5, "k": "auto", "stop": "\n", "n": 2}, DEFAULTS)
    assert args.prompt_token_ids == (4, 5, 6) and args.sampling.stop == ("\n",) and args.spec.k is None and args.n == 2
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                       "max_completion_tokens": 9, "contract": "exact", "temperature": 0.5}, DEFAULTS)
    assert chat.chat and chat.messages == (("user", "hi"),) and chat.sampling.max_tokens == 9
    with pytest.raises(InvalidRequestError) as info:
        parse_chat({"messages": []}, DEFAULTS)
    assert info.value.field == "messages"
    with pytest.raises(InvalidRequestError) as info:
        parse_chat({"messages": [{"role": "user", "content": 3}]}, DEFAULTS)
    assert info.value.field == "messages[0].content"


def test_openai_bodies() -> None:
    collected = Collected(n=2)
    for index in (1, 0):
        collected.add(IndexedChunk(index, TokenChunk("r", [1, 2], "ab", proposed=3, accepted=1), "greedy"))
        collected.add(IndexedChunk(index, TokenChunk("r", [3], "c", finish_reason="eos",
                                                     stats={"prompt_tokens": 4}), "greedy"))
    body = completion_body("r", "m", collected, chat=False)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"] == "abc" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    assert body["specserve"]["proposed"] == 6 and body["specserve"]["accepted"] == 2
    chat = completion_body("r", "m", collected, chat=True)
    assert chat["choices"][1]["message"] == {"role": "assistant", "content": "abc"}
    event = sse_event("r", "m", IndexedChunk(0, TokenChunk("r", [1], "a"), "greedy"), chat=True, first=True)
    assert event.startswith("data: ") and event.endswith("\n\n")
    payload = json.loads(event[len("data: "):])
    assert payload["choices"][0]["delta"] == {"content": "a", "role": "assistant"}
