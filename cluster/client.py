"""A small Python client of the specserve gRPC API (and `specserve generate --server HOST:PORT`).

    client = SpecServeClient("127.0.0.1:9000")
    for item in client.generate("def fib(n):", max_tokens=32, draft="ngram"):
        print(item.chunk.text_delta, end="")
    client.health(); client.list_models(); client.stats()

Status codes come back as specserve errors: INVALID_ARGUMENT -> InvalidRequestError (with .field),
RESOURCE_EXHAUSTED -> CapacityError (with .retry_after_s), anything else -> SpecServeError (with .code).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from specserve_types.api import CapacityError, InvalidRequestError, SpecServeError
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.proto import specserve_pb2_grpc as pb_grpc
from specserve_types.protocol import TIMEOUT_METADATA, IndexedChunk, chunk_from_proto

APP_NAME = "specserve"
APP_METADATA = (("application", APP_NAME),)  # optional: a server refuses another name with NOT_FOUND


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


def build_request(prompt: str | Sequence[int] | None = None, **fields: Any) -> pb.GenerateRequest:
    """A GenerateRequest: `prompt` as text or token ids; None-valued fields stay unset (server defaults)."""
    request = pb.GenerateRequest()
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(int(t) for t in prompt)
    for role, content in fields.pop("messages", None) or ():
        request.messages.add(role=role, content=content)
    request.stop.extend(fields.pop("stop", None) or ())
    for name, value in fields.items():
        if value is not None:
            setattr(request, name, value)
    return request


class SpecServeClient:
    def __init__(self, address: str, timeout_s: float | None = None, application: str = APP_NAME) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.metadata = (("application", application),)  # checked by the server (NOT_FOUND if not its own)
        self._channel = grpc.insecure_channel(address)
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
        contract=, k=, draft=, n=, seed=, chat=, messages=[(role, content)], request_id=, ...)."""
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
    """Accumulate a stream into {index: {"token_ids", "text", "finish_reason", "proposed", "accepted", "stats"}}."""
    samples: dict[int, dict[str, Any]] = {}
    for item in stream:
        sample = samples.setdefault(item.index, {"token_ids": [], "text": "", "finish_reason": None,
                                                 "proposed": 0, "accepted": 0, "stats": None,
                                                 "contract": item.contract})
        sample["token_ids"].extend(item.chunk.token_ids)
        sample["text"] += item.chunk.text_delta
        sample["proposed"] += item.chunk.proposed
        sample["accepted"] += item.chunk.accepted
        if item.chunk.finished:
            sample["finish_reason"] = item.chunk.finish_reason
            sample["stats"] = item.chunk.stats
    return samples
