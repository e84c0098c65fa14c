"""OpenAI-compatible HTTP bodies: parse into GenerateArgs (field-named 400s), format results and SSE events.

Supported: /v1/completions (prompt: string, [token ids], or a batch of one of these) and
/v1/chat/completions (messages with roles system/user/assistant, content text or text parts), `stream`
(server-sent events ending in `data: [DONE]`) with `stream_options.include_usage` (a last chunk with
`choices: []` and `usage`; `stream_options` without `stream: true` is refused), n, stop, seed, max_tokens
(`max_completion_tokens` for chat), temperature, top_p, presence/frequency_penalty. Extensions: top_k, min_p,
repetition_penalty, ignore_eos, and speculation: contract, k ("auto" or 0..8), draft. Defaults are
specserve's (specserve_types.api.SamplingParams: greedy, max_tokens 64), not OpenAI's. Each response carries
`specserve`: the contract used, proposed/accepted draft tokens and per-choice statistics.

Bodies are validated by the pydantic models of cluster/serving/openai_models.py (strict types, the server's
bounds), then by specserve_types (GenerateArgs, SamplingParams: unpaired surrogates, lengths). Unknown fields
are ignored. Parameters that would silently change what the client gets are refused with a 400 naming the
parameter unless they carry their no-op value (openai_models.REFUSED):
    best_of (only 1), echo (only false), suffix (only ""), logprobs (only 0 / false), top_logprobs (only 0),
    logit_bias (only {}), tools and functions (only []), tool_choice and function_call (only "none"),
    response_format (only {"type": "text"}), audio, prediction and web_search_options (only null),
    modalities (only ["text"]).
Accepted without effect: parallel_tool_calls (no tools), stream_options.include_obfuscation, user and any other
unknown field.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from cluster.engine.request_span import RequestSpan, summed_speculation
from cluster.serving.openai_models import (
    REFUSED,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ResponseFormatText,
    StreamOptions,
    TextPart,
)
from specserve_types.api import MAX_K, InvalidRequestError, SamplingParams, SpecParams
from specserve_types.protocol import GenerateArgs, IndexedChunk, ServerDefaults, new_request_id

OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}
MAX_QUOTED_CHARS = 60  # a refused value quoted back to the client (and into the log), shortened

# Names a pydantic error location may hold: field names (anything else in a location is a union member's tag)
FIELD_NAMES = frozenset(name for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart,
                                           StreamOptions, ResponseFormatText) for name in model.model_fields)
# What a field of several accepted forms must be (a union's errors list every form's failure)
FORMS = {
    "prompt": "must be a non-empty string, a non-empty list of token ids (>= 0), or a batch of one of these",
    "stop": "must be a non-empty string or a list of non-empty strings",
    "k": f"must be an integer in [0, {MAX_K}] or \"auto\"",
    "content": "must be a non-empty string or a non-empty list of text parts ({\"type\": \"text\", \"text\": ...}); "
               "only text is supported",
}
TYPE_MESSAGES = {
    "missing": "is required", "string_type": "must be a string", "int_type": "must be an integer",
    "float_type": "must be a number", "bool_type": "must be a boolean", "list_type": "must be a list",
    "dict_type": "must be an object", "model_type": "must be an object", "model_attributes_type": "must be an object",
    "none_required": "must be null",
}
BOUND_MESSAGES = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
BOUND_KEYS = {"greater_than_equal": "ge", "greater_than": "gt", "less_than_equal": "le", "less_than": "lt"}


def quoted(value: Any) -> str:
    text = ascii(value)  # escaped: one line, no unpaired surrogate in the answer or the log
    return text if len(text) <= MAX_QUOTED_CHARS else text[:MAX_QUOTED_CHARS] + "..."


def describe(error: dict[str, Any]) -> str:
    """One pydantic error as specserve words it ("must be an integer, got 'x'")."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in BOUND_MESSAGES:
        bound = ctx[BOUND_KEYS[kind]]
        message = f"must be {BOUND_MESSAGES[kind]} {f'{bound:g}' if isinstance(bound, float) else bound}"
    elif kind == "literal_error":
        message = f"must be {ctx['expected']}"
    elif kind == "string_too_short":
        return "must be non-empty" if ctx.get("min_length") == 1 else f"must be at least {ctx['min_length']} characters"
    elif kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters"
    elif kind == "too_short":
        return f"must hold at least {ctx['min_length']} item{'s' if ctx['min_length'] != 1 else ''}"
    elif kind == "too_long":
        return f"must hold at most {ctx['max_length']} item{'s' if ctx['max_length'] != 1 else ''}"
    else:
        message = TYPE_MESSAGES.get(kind, error["msg"][:1].lower() + error["msg"][1:])
    return message if kind == "missing" else f"{message}, got {quoted(error['input'])}"


def invalid(exc: ValidationError) -> InvalidRequestError:
    """The request's first error, naming its parameter as the client wrote it (`messages[0].content`)."""
    error = exc.errors(include_url=False)[0]
    loc = error["loc"]
    if not loc:
        return InvalidRequestError("body", "must be a JSON object")
    if loc[0] in REFUSED:
        return InvalidRequestError(str(loc[0]), REFUSED[str(loc[0])])
    path, last = "", ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in FIELD_NAMES:
            path, last = (f"{path}.{part}" if path else part), part
        else:  # a union member's tag: every accepted form failed
            return InvalidRequestError(path, FORMS.get(last) or describe(error))
    return InvalidRequestError(path, describe(error))


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed request: what to generate, and how to answer it."""

    args: GenerateArgs
    stream: bool = False
    include_usage: bool = False


def validated(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid(exc) from None


def _set(**values: Any) -> dict[str, Any]:
    return {name: value for name, value in values.items() if value is not None}


def _common(request: CompletionRequest | ChatCompletionRequest, defaults: ServerDefaults, max_tokens: int | None,
            request_id: str) -> dict[str, Any]:
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError("stream_options", "is only allowed with stream: true")
    defaults.check_model(request.model or "")
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    sampling = SamplingParams(**_set(
        temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, min_p=request.min_p,
        repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, seed=request.seed, max_tokens=max_tokens, stop=stop,
        ignore_eos=request.ignore_eos))
    spec = SpecParams(contract=request.contract or defaults.contract(sampling.temperature),
                      k=None if request.k in (None, "auto") else request.k, draft=request.draft or defaults.draft)
    return {"request_id": request_id, "sampling": sampling, "spec": spec, "n": request.n or 1}


def parse_request(body: Any, defaults: ServerDefaults, chat: bool, request_id: str | None = None) -> OpenAIRequest:
    """Validate an OpenAI body (already JSON-decoded); raises InvalidRequestError naming the parameter."""
    request_id = request_id or new_request_id()
    if chat:
        request = validated(ChatCompletionRequest, body)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        messages = tuple((m.role, m.content if isinstance(m.content, str) else "".join(p.text for p in m.content))
                         for m in request.messages)
        args = GenerateArgs(messages=messages, chat=True, **_common(request, defaults, max_tokens, request_id))
    else:
        request = validated(CompletionRequest, body)
        prompt = request.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        common = _common(request, defaults, request.max_tokens, request_id)
        if isinstance(prompt, str):
            args = GenerateArgs(prompt_text=prompt, **common)
        else:
            args = GenerateArgs(prompt_token_ids=tuple(prompt), **common)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return OpenAIRequest(args, stream=bool(request.stream), include_usage=include_usage)


def parse_completion(body: Any, defaults: ServerDefaults) -> GenerateArgs:
    return parse_request(body, defaults, chat=False).args


def parse_chat(body: Any, defaults: ServerDefaults) -> GenerateArgs:
    return parse_request(body, defaults, chat=True).args


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

    def finish_span(self, span: RequestSpan, model: str) -> None:
        ordered = [self.choices[index] for index in sorted(self.choices)]
        span.finish(model, [c.stats for c in ordered], [c.finish_reason for c in ordered])

    def metrics(self) -> dict[str, Any]:
        """`metrics.speculative_decoding` of the response (vLLM's shape), all completions together."""
        return {"speculative_decoding": summed_speculation([c.stats for c in self.choices.values()])}

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
            "model": model, "choices": choices, "usage": collected.usage(), "metrics": collected.metrics(),
            "specserve": collected.specserve()}


def sse_data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"  # ASCII-escaped JSON: one line


def sse_event(request_id: str, model: str, item: IndexedChunk, chat: bool, first: bool,
              include_usage: bool = False) -> str:
    chunk = item.chunk
    finish = OPENAI_FINISH.get(chunk.finish_reason or "", chunk.finish_reason) if chunk.finished else None
    spec = {"proposed": chunk.proposed, "accepted": chunk.accepted, "token_ids": chunk.token_ids,
            "offset": chunk.offset, "contract": item.contract}
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
    if include_usage:
        event["usage"] = None  # as OpenAI: null on every chunk but the last
    return sse_data(event)


def usage_event(request_id: str, model: str, collected: Collected, chat: bool) -> str:
    """The last chunk with stream_options.include_usage: no choices, the request's token counts."""
    return sse_data({"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": int(time.time()), "model": model, "choices": [], "usage": collected.usage(),
                   "metrics": collected.metrics()})


SSE_DONE = "data: [DONE]\n\n"


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

