"""A request body read as JSON within bounds: at most MAX_BODY_BYTES, nested at most MAX_JSON_DEPTH deep, at most
MAX_JSON_CONTAINERS objects and arrays (each is validated as a model afterwards: 300,000 small objects took pydantic
3 s of the ingress's event loop), strict JSON.

Every way a body can be wrong is the client's, and raises BodyError (HTTP 413 for size, 400 otherwise),
never an exception the server would answer with a 500: a body too large (by its Content-Length, or while
it streams in), bytes that are not UTF-8 JSON, JavaScript constants JSON does not have (NaN, Infinity),
integers of more than 4300 digits (Python's int limit), and nesting too deep for the parser's recursion
(a 100,000-deep `[[[...` raises RecursionError inside json.loads) or beyond MAX_JSON_DEPTH.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Mapping
from typing import Any

MAX_BODY_BYTES = 8 << 20  # 8 MiB: a 1 MiB prompt (specserve_types.protocol.MAX_PROMPT_CHARS) fits even \u-escaped
MAX_JSON_DEPTH = 32  # an OpenAI body nests ~5 deep (body > messages > message > content parts > part)
MAX_JSON_CONTAINERS = 1 << 15  # objects and arrays of a body: 2048 messages with tool calls, 128 tools' schemas fit


class BodyError(Exception):
    """A request body refused before parsing its fields; `status` is 400 or 413."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def depth(value: Any, max_containers: int | None = None) -> int:
    """How deep containers nest in a parsed JSON value (a scalar is 0, `[]` and `{}` are 1); iterative. BodyError(400)
    past `max_containers` objects and arrays."""
    deepest, containers = 0, 0
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        container, level = stack.pop()
        deepest = max(deepest, level)
        containers += 1
        if max_containers is not None and containers > max_containers:
            raise BodyError(400, f"more than {max_containers} objects and arrays")
        children = container.values() if isinstance(container, dict) else container
        stack.extend((child, level + 1) for child in children if isinstance(child, (list, dict)))
    return deepest


def parse_json(data: bytes, max_depth: int = MAX_JSON_DEPTH, max_containers: int = MAX_JSON_CONTAINERS) -> Any:
    """Strict JSON from bytes, nested at most `max_depth` deep, of at most `max_containers` objects and arrays;
    raises BodyError(400)."""
    try:
        value = json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:
        raise BodyError(400, f"nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity, an int beyond 4300 digits
        raise BodyError(400, f"not valid JSON: {exc}") from None
    if depth(value, max_containers) > max_depth:
        raise BodyError(400, f"nested deeper than {max_depth} levels")
    return value


async def read_body(headers: Mapping[str, str], chunks: AsyncIterable[bytes], limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole body, refused (BodyError 413) as soon as it is known to exceed `limit` bytes."""
    declared = headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise BodyError(413, f"larger than {limit} bytes ({int(declared)})")
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)
