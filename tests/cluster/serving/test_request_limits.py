"""What one request may ask (docs/api.md, "Limits"), on both front doors: the HTTP body (openai_api.parse_request)
and the gRPC message (protocol.request_from_proto) refuse the same oversized field, named, before anything is built
of it; the server's limits come from ClusterConfig."""

from __future__ import annotations

import time
from typing import Any

import pytest

from cluster.client import build_request
from cluster.serving.config import load_config
from cluster.serving.json_body import MAX_JSON_CONTAINERS, BodyError, parse_json
from cluster.serving.openai_api import parse_request
from specserve_types.api import InvalidRequestError
from specserve_types.protocol import MAX_PROMPT_CHARS, RequestLimits, ServerDefaults, request_from_proto

CONFIG = load_config(model="smollm2-135m", draft="ngram")
DEFAULTS = ServerDefaults("smollm2-135m", "ngram", CONFIG.request_limits())
MESSAGE = {"role": "user", "content": "hi"}


def http(fields: dict[str, Any], defaults: ServerDefaults = DEFAULTS) -> Any:
    chat = "messages" in fields
    body = {**({} if chat or "prompt" in fields else {"prompt": "x"}), **fields}
    return parse_request(body, defaults, chat=chat).args


def grpc(fields: dict[str, Any], defaults: ServerDefaults = DEFAULTS) -> Any:
    fields = dict(fields)
    prompt = fields.pop("prompt", None if "messages" in fields else "x")
    if "messages" in fields:
        fields["chat"] = True
    constraint = fields.pop("structured_outputs", {})
    request = build_request(prompt, **fields)
    for kind, value in constraint.items():  # as sent, not as the client checks it
        setattr(request.constraint, kind, value)
    return request_from_proto(request, defaults)[0]


DOORS = {"http": http, "grpc": grpc}

# (case, fields, the field named on HTTP, on gRPC, words of the message)
REFUSED = [
    ("stop strings", {"stop": ["s"] * 65}, "stop", "stop", "at most 64 stop strings, got 65"),
    ("a long stop string", {"stop": ["s" * 257]}, "stop", "stop", "each stop string at most 256 characters"),
    ("stop characters in all", {"stop": ["s" * 256] * 17}, "stop", "stop", "at most 4096 characters of stop strings"),
    ("n x max_tokens", {"n": 16, "max_tokens": 1025}, "n", "n", "n (16) x max_tokens (1025) = 16400 exceeds the 16384"),
    ("messages", {"messages": [MESSAGE] * 2049}, "messages", "messages", "at most 2048 messages, got 2049"),
    ("token ids past the context", {"prompt": [1] * 2049, "max_tokens": 0, "echo": True}, "prompt", "prompt",
     "prompt (2049 tokens) exceeds the context of 2048 tokens"),
    ("token ids and max_tokens", {"prompt": [1] * 2000, "max_tokens": 64}, "prompt", "prompt",
     "prompt (2000 tokens) + max_tokens (64) exceeds the context of 2048"),
    ("prompt text", {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt", "prompt", "1048576 characters"),
    ("logit_bias entries", {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "logit_bias", "1024"),
    ("tools", {"messages": [MESSAGE], "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                               for i in range(129)]}, "tools", "tools", "at most 128 items"),
    ("a constraint's characters", {"structured_outputs": {"regex": "a" * (64 * 1024 + 1)}},
     "structured_outputs.regex", "constraint.regex", "longer than 65536 characters"),
    ("logprobs", {"logprobs": 21}, "logprobs", "logprobs", "20"),
]


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.parametrize(("fields", "http_field", "grpc_field", "words"), [case[1:] for case in REFUSED],
                         ids=[case[0] for case in REFUSED])
def test_each_limit_is_refused_naming_the_field(door: str, fields: dict[str, Any], http_field: str, grpc_field: str,
                                                words: str) -> None:
    if door == "grpc" and "logit_bias" in fields:
        fields = {"logit_bias": {i: 1.0 for i in range(1025)}}
    with pytest.raises(InvalidRequestError) as refused:
        DOORS[door](fields)
    assert refused.value.field == (http_field if door == "http" else grpc_field)
    assert words in refused.value.message, refused.value.message


@pytest.mark.parametrize("door", sorted(DOORS))
def test_up_to_each_limit_is_taken(door: str) -> None:
    parse = DOORS[door]
    assert len(parse({"stop": ["s" * 64] * 64}).sampling.stop) == 64  # 64 of 64: 4096 characters
    assert len(parse({"stop": ["s" * 256] * 16}).sampling.stop) == 16
    assert parse({"n": 16, "max_tokens": 1024}).n == 16
    assert len(parse({"messages": [MESSAGE] * 2048}).messages) == 2048
    assert len(parse({"prompt": [1] * 1984, "max_tokens": 64}).prompt_token_ids) == 1984


@pytest.mark.parametrize("door", sorted(DOORS))
def test_the_servers_own_limits(door: str) -> None:
    config = load_config(model="smollm2-135m", draft="ngram", max_stop_strings=2, max_stop_string_chars=3,
                         max_stop_chars=5, max_messages=2, max_request_tokens=100, max_context=64)
    defaults = ServerDefaults("smollm2-135m", "ngram", config.request_limits())
    cases = [({"stop": ["a", "b", "c"]}, "stop"), ({"stop": ["abcd"]}, "stop"), ({"stop": ["abc", "abc"]}, "stop"),
             ({"messages": [MESSAGE] * 3}, "messages"), ({"max_tokens": 101}, "max_tokens"),
             ({"n": 2, "max_tokens": 51}, "n"), ({"prompt": [1] * 60, "max_tokens": 5}, "prompt")]
    for fields, field_name in cases:
        with pytest.raises(InvalidRequestError) as refused:
            DOORS[door](fields, defaults)
        assert refused.value.field == field_name, fields
    assert DOORS[door]({"stop": ["ab", "abc"], "max_tokens": 100}, defaults).sampling.max_tokens == 100


def test_the_config_carries_every_limit() -> None:
    config = load_config(model="smollm2-135m", draft="ngram", max_stop_strings=1, max_stop_string_chars=2,
                         max_stop_chars=3, max_messages=4, max_request_tokens=5, max_context=64)
    assert config.request_limits() == RequestLimits(max_context=64, max_stop_strings=1, max_stop_string_chars=2,
                                                    max_stop_chars=3, max_messages=4, max_request_tokens=5)
    assert CONFIG.request_limits() == RequestLimits(max_context=2048)  # the defaults agree
    assert CONFIG.tokenizer_threads == 1


def test_http_counts_before_it_validates_each_item() -> None:
    """A body's list past its limit is refused by its length, whatever its items (which are not looked at)."""
    for body, field_name in (({"prompt": "x", "stop": [0] * 100}, "stop"),
                             ({"messages": [0] * 300_000}, "messages"),
                             ({"prompt": [0] * 1_000_000}, "prompt"),
                             ({"prompt": [[0] * 1_000_000]}, "prompt")):
        started = time.perf_counter()
        with pytest.raises(InvalidRequestError) as refused:
            parse_request(body, DEFAULTS, chat="messages" in body)
        message = refused.value.message
        assert refused.value.field == field_name and ("at most" in message or "exceeds" in message), message
        assert time.perf_counter() - started < 0.2  # pydantic took 3.3 s of 300,000 messages


def test_a_body_of_too_many_objects_is_refused_before_the_models_read_it() -> None:
    many = b'{"messages": [' + b",".join([b'{"role": "user", "content": "x"}'] * (MAX_JSON_CONTAINERS + 1)) + b"]}"
    with pytest.raises(BodyError) as refused:
        parse_json(many)
    assert refused.value.status == 400 and f"more than {MAX_JSON_CONTAINERS} objects and arrays" in \
        refused.value.message
    assert len(parse_json(b"[" + b",".join([b"{}"] * (MAX_JSON_CONTAINERS - 1)) + b"]")) == MAX_JSON_CONTAINERS - 1
