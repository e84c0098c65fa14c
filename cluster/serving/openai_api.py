"""OpenAI-compatible HTTP bodies: parse into GenerateArgs (field-named 400s), format results and SSE events.

Supported: /v1/completions (prompt: string, [string] or [token ids]) and /v1/chat/completions
(messages), `stream` (server-sent events ending in `data: [DONE]`), n, stop, seed, max_tokens
(`max_completion_tokens` for chat), temperature, top_p, presence/frequency_penalty. Extensions:
top_k, min_p, repetition_penalty, ignore_eos, and speculation: contract, k ("auto" or 0..8), draft.
Defaults are specserve's (specserve_types.api.SamplingParams: greedy, max_tokens 64), not OpenAI's.
Each response carries `specserve`: the contract used, proposed/accepted draft tokens and per-choice
statistics. Unknown fields are ignored; features that would silently change semantics are refused.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from specserve_types.api import InvalidRequestError, SamplingParams, SpecParams
from specserve_types.protocol import GenerateArgs, IndexedChunk, ServerDefaults, new_request_id

REFUSED_FEATURES = ("logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "tools", "functions")
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def _number(body: dict, name: str, default: Any, kind: type) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise InvalidRequestError(name, f"must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequestError("stop", "must be a string or a list of strings")
    return tuple(stop)


def _spec(body: dict, defaults: ServerDefaults, temperature: float) -> SpecParams:
    k = body.get("k")
    if k == "auto":
        k = None
    elif k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise InvalidRequestError("k", f"must be an integer in [0, 8] or 'auto', got {k!r}")
    for name in ("contract", "draft"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise InvalidRequestError(name, "must be a string")
    return SpecParams(contract=body.get("contract") or defaults.contract(temperature), k=k,
                      draft=body.get("draft") or defaults.draft)


def _common(body: Any, defaults: ServerDefaults, max_tokens_names: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise InvalidRequestError("model", "must be a string")
    defaults.check_model(model)
    for name in REFUSED_FEATURES:
        if body.get(name) not in (None, False, 0, [], {}):
            raise InvalidRequestError(name, "is not supported by specserve")
    base = SamplingParams()
    max_tokens = base.max_tokens
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = _number(body, name, base.max_tokens, int)
            break
    if not isinstance(body.get("ignore_eos", False), bool):
        raise InvalidRequestError("ignore_eos", "must be a boolean")
    sampling = SamplingParams(
        temperature=_number(body, "temperature", base.temperature, float),
        top_k=_number(body, "top_k", base.top_k, int),
        top_p=_number(body, "top_p", base.top_p, float),
        min_p=_number(body, "min_p", base.min_p, float),
        repetition_penalty=_number(body, "repetition_penalty", base.repetition_penalty, float),
        presence_penalty=_number(body, "presence_penalty", base.presence_penalty, float),
        frequency_penalty=_number(body, "frequency_penalty", base.frequency_penalty, float),
        seed=_number(body, "seed", None, int),
        max_tokens=max_tokens,
        stop=_stop(body),
        ignore_eos=body.get("ignore_eos", False),
    )
    if not isinstance(body.get("stream", False), bool):
        raise InvalidRequestError("stream", "must be a boolean")
    return {"sampling": sampling, "spec": _spec(body, defaults, sampling.temperature), "n": _number(body, "n", 1, int),
            "request_id": new_request_id()}


def parse_completion(body: Any, defaults: ServerDefaults) -> GenerateArgs:
    common = _common(body, defaults, ("max_tokens",))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return GenerateArgs(prompt_text=prompt, **common)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return GenerateArgs(prompt_token_ids=tuple(prompt), **common)
    if prompt is None:
        raise InvalidRequestError("prompt", "is required")
    raise InvalidRequestError("prompt", "must be a string, a list of token ids, or a batch of one")


def parse_chat(body: Any, defaults: ServerDefaults) -> GenerateArgs:
    common = _common(body, defaults, ("max_completion_tokens", "max_tokens"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list")
    parsed: list[tuple[str, str]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{index}]", "must be an object with role and content")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
                raise InvalidRequestError(f"messages[{index}].content", "only text parts are supported")
            content = "".join(str(part.get("text", "")) for part in content)
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{index}].content", "must be a string")
        parsed.append((str(message.get("role", "")), content))
    return GenerateArgs(messages=tuple(parsed), chat=True, **common)


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    proposed: int = 0
    accepted: int = 0
    stats: dict | None = None


@dataclass
class Collected:
    """The chunks of one request, accumulated per completion index."""

    n: int
    contract: str = ""
    choices: dict[int, Choice] = field(default_factory=dict)

    def add(self, item: IndexedChunk) -> None:
        choice = self.choices.setdefault(item.index, Choice())
        chunk = item.chunk
        choice.text += chunk.text_delta
        choice.token_ids.extend(chunk.token_ids)
        choice.proposed += chunk.proposed
        choice.accepted += chunk.accepted
        self.contract = item.contract
        if chunk.finished:
            choice.finish_reason = chunk.finish_reason
            choice.stats = chunk.stats

    def usage(self) -> dict[str, int]:
        prompt_tokens = next((int(c.stats.get("prompt_tokens", 0)) for c in self.choices.values() if c.stats), 0)
        completion_tokens = sum(len(c.token_ids) for c in self.choices.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def specserve(self) -> dict[str, Any]:
        ordered = [self.choices[index] for index in sorted(self.choices)]
        return {"contract": self.contract, "proposed": sum(c.proposed for c in ordered),
                "accepted": sum(c.accepted for c in ordered), "stats": [c.stats for c in ordered]}


def completion_body(request_id: str, model: str, collected: Collected, chat: bool) -> dict[str, Any]:
    choices = []
    for index in sorted(collected.choices):
        choice = collected.choices[index]
        finish = OPENAI_FINISH.get(choice.finish_reason or "", choice.finish_reason)
        if chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": choice.text},
                            "finish_reason": finish, "logprobs": None})
        else:
            choices.append({"index": index, "text": choice.text, "finish_reason": finish, "logprobs": None,
                            "token_ids": choice.token_ids})
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": collected.usage(), "specserve": collected.specserve()}


def sse_event(request_id: str, model: str, item: IndexedChunk, chat: bool, first: bool) -> str:
    chunk = item.chunk
    finish = OPENAI_FINISH.get(chunk.finish_reason or "", chunk.finish_reason) if chunk.finished else None
    spec = {"proposed": chunk.proposed, "accepted": chunk.accepted, "token_ids": chunk.token_ids,
            "contract": item.contract}
    if chunk.finished:
        spec["stats"] = chunk.stats
    if chat:
        delta: dict[str, Any] = {"content": chunk.text_delta}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": item.index, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": item.index, "text": chunk.text_delta, "finish_reason": finish, "logprobs": None}
    event = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
             "created": int(time.time()), "model": model, "choices": [choice], "specserve": spec}
    return f"data: {json.dumps(event)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
