"""A small Python client of the specserve gRPC API (and `specserve generate --server HOST:PORT`).

    client = SpecServeClient("127.0.0.1:9000")
    for item in client.generate("def fib(n):", max_tokens=32, draft="ngram"):
        print(item.chunk.text_delta, end="")
    client.health(); client.list_models(); client.stats()

Credentials (docs/security.md): `SpecServeClient(address, credentials=Credentials(api_key=..., tls=True,
ca_file=...))`; by default `Credentials.from_env()`: SPECSERVE_API_KEY or SPECSERVE_API_KEY_FILE (the file's
first key), SPECSERVE_TLS_CA_FILE (PEM roots to trust; turns TLS on) or SPECSERVE_TLS=1 (TLS, system roots).
The key travels as `authorization: Bearer KEY` metadata; a server without keys ignores it.

Tool calls (docs/api.md, "Tool calls"), as the OpenAI door takes them: `client.generate(chat=True,
messages=[...], tools=[{"type": "function", "function": {"name", "description", "parameters"}}],
tool_choice="required", parallel_tool_calls=False)`; messages are (role, content) pairs or OpenAI's dicts (an
assistant's `tool_calls`, a tool result's `tool_call_id`). Each chunk's `tool_calls` (IndexedChunk.tool_calls) are
the calls its text completed; the last chunk's finish_reason may then be "tool_calls".

Status codes come back as specserve errors: INVALID_ARGUMENT -> InvalidRequestError (with .field),
RESOURCE_EXHAUSTED -> CapacityError (with .retry_after_s), anything else -> SpecServeError (with .code).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from specserve_types.api import CapacityError, Constraint, InvalidRequestError, RowLogprobs, SpecServeError
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.proto import specserve_pb2_grpc as pb_grpc
from specserve_types.protocol import (
    JSON_OBJECT_SCHEMA,
    TIMEOUT_METADATA,
    IndexedChunk,
    choice_constraint,
    chunk_from_proto,
    constraint_to_proto,
    json_schema_constraint,
    logit_bias_pairs,
)

APP_NAME = "specserve"
APP_METADATA = (("application", APP_NAME),)  # optional: a server refuses another name with NOT_FOUND


ENV_API_KEY = "SPECSERVE_API_KEY"
ENV_API_KEY_FILE = "SPECSERVE_API_KEY_FILE"
ENV_TLS_CA_FILE = "SPECSERVE_TLS_CA_FILE"
ENV_TLS = "SPECSERVE_TLS"


def first_key(path: str) -> str:
    """The first key of a key file (one a line, `#` comments), the server's format."""
    for line in Path(path).read_text().splitlines():
        if key := line.split("#", 1)[0].strip():
            return key
    raise SpecServeError(f"API key file {path} holds no key")


@dataclass(frozen=True)
class Credentials:
    """What a client presents (an API key) and how it talks (TLS, trusting `ca_file` or the system roots)."""

    api_key: str | None = field(default=None, repr=False)
    tls: bool = False
    ca_file: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Credentials:
        key = environ.get(ENV_API_KEY) or None
        if key is None and environ.get(ENV_API_KEY_FILE):
            key = first_key(environ[ENV_API_KEY_FILE])
        ca_file = environ.get(ENV_TLS_CA_FILE) or None
        tls = ca_file is not None or environ.get(ENV_TLS, "").lower() in ("1", "true", "yes")
        return cls(key, tls, ca_file)

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def http_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def http_verify(self) -> bool | str:
        """`requests`' verify: the CA file, or True (system roots)."""
        return self.ca_file or True

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def channel(self, address: str) -> grpc.Channel:
        if not self.tls:
            return grpc.insecure_channel(address)
        roots = Path(self.ca_file).read_bytes() if self.ca_file else None
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=roots))


class RemoteError(SpecServeError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def retry_after(error: grpc.RpcError) -> float | None:
    """The server's `retry-after` hint (seconds) from a call's trailing metadata, if it sent one."""
    trailing = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == "retry-after":
            try:
                return float(value)
            except ValueError:
                return None
    return None


def map_rpc_error(error: grpc.RpcError) -> SpecServeError:
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field_name, _, message = details.partition(": ")
        return InvalidRequestError(field_name, message) if message else InvalidRequestError("request", details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityError(details, retry_after(error))
    return RemoteError(code, details)


class GenerateStream:
    """The chunks of one Generate call, in order; `cancel()` ends it (the server aborts the request)."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[IndexedChunk]:
        return self

    def __next__(self) -> IndexedChunk:
        try:
            return chunk_from_proto(next(self._call))
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED and self._call.cancelled():
                raise StopIteration from None
            raise map_rpc_error(error) from None

    def cancel(self) -> None:
        self._call.cancel()


CONSTRAINT_KWARGS = ("constraint", "json_schema", "json_object", "regex", "choice", "grammar")


def constraint_of(fields: dict[str, Any]) -> Constraint | None:
    """The request's constraint from build_request's keyword arguments (popped from `fields`): `constraint=`
    a specserve_types.api.Constraint, or one of `json_schema=` (JSON text or a dict), `json_object=True`,
    `regex=`, `choice=[...]`, `grammar=` (llguidance's Lark syntax). At most one; None values are unset."""
    given = {name: value for name in CONSTRAINT_KWARGS if (value := fields.pop(name, None)) is not None}
    given = {name: value for name, value in given.items() if not (name == "json_object" and value is False)}
    if len(given) > 1:
        raise InvalidRequestError("constraint", f"at most one constraint, got {', '.join(given)}")
    if not given:
        return None
    ((name, value),) = given.items()
    if name == "constraint":
        if not isinstance(value, Constraint):
            raise InvalidRequestError("constraint", f"must be a specserve_types.api.Constraint, got "
                                                    f"{type(value).__name__}")
        return value
    if name == "json_schema":
        return json_schema_constraint(value, name)
    if name == "json_object":
        return Constraint("json", JSON_OBJECT_SCHEMA, name)
    if name == "choice":
        return choice_constraint(value, name)
    if not isinstance(value, str):
        raise InvalidRequestError(name, f"must be a string, got {type(value).__name__}")
    return Constraint(name, value, name)


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def message_to_proto(message: Any, index: int) -> pb.ChatMessage:
    """A chat message: a (role, content) pair, or OpenAI's dict {"role", "content", "tool_calls": [{"id", "type":
    "function", "function": {"name", "arguments": JSON text or an object}}], "tool_call_id"} (content None: "")."""
    if isinstance(message, pb.ChatMessage):
        return message
    if not isinstance(message, Mapping):
        role, content = message
        return pb.ChatMessage(role=role, content=content)
    try:
        calls = [pb.ToolCall(id=call.get("id", ""), name=call["function"]["name"],
                             arguments=_arguments(call["function"].get("arguments", {})))
                 for call in message.get("tool_calls") or ()]
        return pb.ChatMessage(role=message["role"], content=message.get("content") or "", tool_calls=calls,
                              tool_call_id=message.get("tool_call_id") or "")
    except (KeyError, TypeError, AttributeError) as exc:
        raise InvalidRequestError(f"messages[{index}]", f"must be a (role, content) pair or an OpenAI message "
                                                        f"dict ({type(exc).__name__}: {exc})") from None


def tool_to_proto(tool: Any, index: int) -> pb.Tool:
    """A tool: OpenAI's {"type": "function", "function": {"name", "description", "parameters": a JSON Schema (an
    object, or its JSON text)}}, or a pb.Tool."""
    if isinstance(tool, pb.Tool):
        return tool
    try:
        function = tool["function"]
        parameters = function.get("parameters")
        return pb.Tool(name=function["name"], description=function.get("description") or "",
                       parameters_json="" if parameters is None else _arguments(parameters))
    except (KeyError, TypeError, AttributeError) as exc:
        raise InvalidRequestError(f"tools[{index}]", f"must be {{\"type\": \"function\", \"function\": "
                                                     f"{{\"name\", ...}}}} ({type(exc).__name__}: {exc})") from None


def tool_choice_to_proto(choice: Any) -> pb.ToolChoice:
    """OpenAI's tool_choice: "none" | "auto" | "required" or {"type": "function", "function": {"name": F}}."""
    if isinstance(choice, pb.ToolChoice):
        return choice
    if isinstance(choice, str):
        return pb.ToolChoice(mode=choice)
    if isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping) and \
            isinstance(choice["function"].get("name"), str):
        return pb.ToolChoice(function=choice["function"]["name"])
    raise InvalidRequestError("tool_choice", f"must be \"none\", \"auto\", \"required\" or {{\"type\": "
                                             f"\"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")


def build_request(prompt: str | Sequence[int] | None = None, **fields: Any) -> pb.GenerateRequest:
    """A GenerateRequest: `prompt` as text or token ids; None-valued fields stay unset (server defaults).
    Constrained decoding: one of `constraint=`, `json_schema=`, `json_object=True`, `regex=`, `choice=`,
    `grammar=` (constraint_of); `logit_bias=` {token id: bias} or (id, bias) pairs. Tool calls: `tools=` (OpenAI's
    tool dicts), `tool_choice=` (OpenAI's), `parallel_tool_calls=`, and `messages=` of (role, content) pairs or
    OpenAI's message dicts."""
    request = pb.GenerateRequest()
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(int(t) for t in prompt)
    for index, message in enumerate(fields.pop("messages", None) or ()):
        request.messages.append(message_to_proto(message, index))
    for index, tool in enumerate(fields.pop("tools", None) or ()):
        request.tools.append(tool_to_proto(tool, index))
    if (tool_choice := fields.pop("tool_choice", None)) is not None:
        request.tool_choice.CopyFrom(tool_choice_to_proto(tool_choice))
    request.stop.extend(fields.pop("stop", None) or ())
    if (constraint := constraint_of(fields)) is not None:
        request.constraint.CopyFrom(constraint_to_proto(constraint))
    request.logit_bias.update(logit_bias_pairs(fields.pop("logit_bias", None) or ()))
    for name, value in fields.items():
        if value is not None:
            setattr(request, name, value)
    return request


class SpecServeClient:
    def __init__(self, address: str, timeout_s: float | None = None, application: str = APP_NAME,
                 credentials: Credentials | None = None) -> None:
        credentials = credentials if credentials is not None else Credentials.from_env()
        self.address = address
        self.timeout_s = timeout_s
        # `application` is checked by the server (NOT_FOUND if not its own)
        self.metadata = (("application", application), *credentials.grpc_metadata())
        self._channel = credentials.channel(address)
        self._stub = pb_grpc.SpecServeStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SpecServeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompt: str | Sequence[int] | None = None, *, timeout_s: float | None = None,
                 **fields: Any) -> GenerateStream:
        """Stream a generation. `fields` are GenerateRequest fields (max_tokens=, temperature=, stop=,
        contract=, k=, draft=, n=, seed=, chat=, messages=[(role, content) or OpenAI's dicts], request_id=, ...),
        the constrained decoding's (json_schema=, json_object=True, regex=, choice=, grammar= or constraint=;
        logit_bias=) and the tool calls' (tools=, tool_choice=, parallel_tool_calls=): build_request."""
        request = build_request(prompt, **fields)
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        metadata = self.metadata
        if timeout is not None:  # the gRPC deadline is enough; the copy helps servers behind a proxy that drops it
            metadata += ((TIMEOUT_METADATA, f"{timeout:.6g}"),)
        return GenerateStream(self._stub.Generate(request, timeout=timeout, metadata=metadata))

    def _unary(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as error:
            raise map_rpc_error(error) from None

    def list_models(self) -> list[dict[str, str]]:
        response = self._unary(self._stub.ListModels, pb.ListModelsRequest())
        return [{"id": m.id, "role": m.role, "draft": m.draft} for m in response.models]

    def health(self) -> tuple[bool, str]:
        response = self._unary(self._stub.Health, pb.HealthRequest())
        return response.ok, response.status

    def stats(self) -> dict[str, Any]:
        return json.loads(self._unary(self._stub.GetStats, pb.GetStatsRequest()).stats_json)


def collect(stream: Iterator[IndexedChunk]) -> dict[int, dict[str, Any]]:
    """Accumulate a stream into {index: {"token_ids", "text", "finish_reason", "proposed", "accepted", "forced",
    "stats", "contract", "tool_calls", "logprobs", "prompt_logprobs", "prompt_token_ids", "prompt_text", "pieces"}}
    (tool_calls: the ToolCalls of a request with tools, in order; logprobs: the output's RowLogprobs (logprobs=N),
    prompt_*: the prompt's (echo=True), pieces: token id -> (text, bytes) of the ids they name; None / () if not
    asked)."""
    samples: dict[int, dict[str, Any]] = {}
    parts: dict[int, list[RowLogprobs]] = {}
    for item in stream:
        sample = samples.setdefault(item.index, {"token_ids": [], "text": "", "finish_reason": None,
                                                 "proposed": 0, "accepted": 0, "forced": 0, "stats": None,
                                                 "contract": item.contract, "tool_calls": [], "logprobs": None,
                                                 "prompt_logprobs": None, "prompt_token_ids": (),
                                                 "prompt_text": None, "pieces": {}})
        sample["tool_calls"].extend(item.tool_calls)
        if item.chunk.logprobs is not None:
            parts.setdefault(item.index, []).append(item.chunk.logprobs)
            sample["logprobs"] = RowLogprobs.concat(parts[item.index])
        if item.chunk.prompt_logprobs is not None:
            sample["prompt_logprobs"] = item.chunk.prompt_logprobs
        if item.prompt_token_ids:
            sample["prompt_token_ids"], sample["prompt_text"] = item.prompt_token_ids, item.prompt_text
        sample["pieces"].update(item.pieces)
        sample["token_ids"].extend(item.chunk.token_ids)
        sample["text"] += item.chunk.text_delta
        sample["proposed"] += item.chunk.proposed
        sample["accepted"] += item.chunk.accepted
        sample["forced"] += item.chunk.forced
        if item.chunk.finished:
            sample["finish_reason"] = item.chunk.finish_reason
            sample["stats"] = item.chunk.stats
    return samples
