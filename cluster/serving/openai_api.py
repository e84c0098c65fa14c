"""OpenAI-compatible HTTP bodies: parse into GenerateArgs (field-named 400s), format results and SSE events.

Supported: /v1/completions (prompt: string, [token ids], or a batch of one of these) and
/v1/chat/completions (messages with roles system/user/assistant/tool, content text or text parts, an assistant's
`tool_calls` and a tool result's `tool_call_id`), `stream`
(server-sent events ending in `data: [DONE]`) with `stream_options.include_usage` (a last chunk with
`choices: []` and `usage`; `stream_options` without `stream: true` is refused), n, stop, seed, max_tokens
(`max_completion_tokens` for chat), temperature, top_p, presence/frequency_penalty. Extensions: top_k, min_p,
repetition_penalty, ignore_eos, and speculation: contract, k ("auto" or 0..8), draft.

Constrained decoding (docs/api.md, "Structured output and tool calls"), at most one constraint a request:
    response_format      {"type": "json_object"} -> Constraint("json", '{"type": "object"}'); {"type": "json_schema",
                         "json_schema": {"name", "schema", "strict", "description"}} -> Constraint("json", schema)
    structured_outputs   vLLM's: exactly one of json, regex, choice, grammar, json_object -> the same kind
    guided_json, guided_regex, guided_choice, guided_grammar: vLLM's older names of the same
    logit_bias           {"50256": -100, ...} -> SamplingParams.logit_bias, sorted (token id, bias) pairs
    tools, tool_choice   chat: the tools go to the chat template; "required" or a named function constrain the output
                         to Qwen2.5's <tool_call> blocks (cluster/serving/tool_calls.py), "auto" leaves it free; the
                         output is read back into `message.tool_calls` (streamed as OpenAI streams them)
Each Constraint names the field it came from, so the engine's refusal of one that does not compile is a 400
naming that field. Defaults are
specserve's (specserve_types.api.SamplingParams: greedy), not OpenAI's, but for max_tokens: as OpenAI and vLLM, a chat
generates until the model ends the answer (at most what the context leaves beside the prompt) and a completion 16
tokens (null: as a chat). Each response carries
`specserve`: the contract used, proposed/accepted draft tokens and per-choice statistics.

Bodies are validated by the pydantic models of cluster/serving/openai_models.py (strict types, the server's
bounds), then by specserve_types (GenerateArgs, SamplingParams: unpaired surrogates, lengths). Unknown fields
are ignored. Parameters that would silently change what the client gets are refused with a 400 naming the
parameter unless they carry their no-op value (openai_models.REFUSED):
    best_of (only 1), echo (only false), suffix (only ""), logprobs (only 0 / false), top_logprobs (only 0),
    functions (only []), function_call (only "none"), audio, prediction, web_search_options and
    guided_whitespace_pattern (only null), modalities (only ["text"]); on /v1/completions tools (only []) and
    tool_choice (only "none"). An unknown key of structured_outputs is refused too.
Accepted without effect: guided_decoding_backend, stream_options.include_obfuscation, user and any other unknown
field.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from cluster.engine.request_span import RequestSpan, summed_speculation
from cluster.serving.logprob_format import Pieces, chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from cluster.serving.openai_models import (
    MESSAGE_MODELS,
    REFUSED,
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    ChatAssistantMessage,
    ChatCompletionRequest,
    ChatToolCall,
    ChatToolMessage,
    CompletionRequest,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    ResponseFormatText,
    StreamOptions,
    StructuredOutputs,
    TextPart,
    Tool,
    ToolChoiceFunction,
)
from cluster.serving.tool_calls import (
    ToolCallStream,
    ToolOutput,
    ends_in_calls,
    message_extra,
    parse_tool_calls,
    resolve_tools,
)
from specserve_types.api import (
    MAX_K,
    Constraint,
    InvalidRequestError,
    RowLogprobs,
    SamplingParams,
    SpecParams,
)
from specserve_types.protocol import (
    CHAT_ROLES,
    JSON_OBJECT_SCHEMA,
    MAX_PROMPT_CHARS,
    GenerateArgs,
    IndexedChunk,
    RequestLimits,
    ServerDefaults,
    choice_constraint,
    json_schema_constraint,
    logit_bias_pairs,
    new_request_id,
)

OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}
MAX_QUOTED_CHARS = 60  # a refused value quoted back to the client (and into the log), shortened

# Names a pydantic error location may hold: field names (anything else in a location is a union member's tag)
REQUEST_PARTS = (CompletionRequest, ChatCompletionRequest, *MESSAGE_MODELS, TextPart, StreamOptions, ChatToolCall,
                 FunctionCall, ResponseFormatText, ResponseFormatJsonObject, ResponseFormatJsonSchema, JsonSchemaFormat,
                 StructuredOutputs, Tool, FunctionDefinition, NamedToolChoice, ToolChoiceFunction)
FIELD_NAMES = frozenset(info.alias or name for model in REQUEST_PARTS for name, info in model.model_fields.items())
# Fields holding a union told apart by a tag (pydantic puts the tag in the location: skipped)
TAGGED = {"messages": frozenset(CHAT_ROLES), "response_format": frozenset({"text", "json_object", "json_schema"})}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# What a field of several accepted forms must be (a union's errors list every form's failure)
FORMS = {
    "prompt": "must be a non-empty string, a non-empty list of token ids (>= 0), or a batch of one of these",
    "stop": "must be a non-empty string or a list of non-empty strings",
    "k": f"must be an integer in [0, {MAX_K}] or \"auto\"",
    "content": "must be a non-empty string or a non-empty list of text parts ({\"type\": \"text\", \"text\": ...}); "
               "only text is supported",
    "tool_choice": "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
    "json": "must be a JSON Schema: an object, or its JSON text",
    "guided_json": "must be a JSON Schema: an object, or its JSON text",
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


def invalid(exc: ValidationError, refused: dict[str, str] = REFUSED) -> InvalidRequestError:
    """The request's first error, naming its parameter as the client wrote it (`messages[0].content`)."""
    error = exc.errors(include_url=False)[0]
    loc, kind = error["loc"], error["type"]
    if not loc:
        return InvalidRequestError("body", "must be a JSON object")
    if loc[0] in refused:
        return InvalidRequestError(str(loc[0]), refused[str(loc[0])])
    if loc[0] == "logit_bias" and len(loc) > 1:  # a key or a value: the client's key is quoted, not a path
        if loc[-1] == "[key]":
            return InvalidRequestError("logit_bias", f"keys must be token ids (strings of up to 10 digits, such as "
                                                     f"\"50256\"), got {quoted(loc[1])}")
        return InvalidRequestError("logit_bias", f"the bias of token {quoted(loc[1])} {describe(error)}")
    path, last, tag_next = "", "", False
    for at, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif tag_next and part in TAGGED[last]:
            tag_next = False
        elif kind == "extra_forbidden" and at == len(loc) - 1:  # a key the object does not take
            known = ", ".join(STRUCTURED_KEYS) if last == "structured_outputs" else "its documented keys"
            return InvalidRequestError(path, f"unknown key {quoted(part)} (specserve takes {known})")
        elif part in FIELD_NAMES:
            path, last, tag_next = (f"{path}.{part}" if path else part), part, part in TAGGED
        else:  # a union member's tag: every accepted form failed
            return InvalidRequestError(path, FORMS.get(last) or describe(error))
    if kind in ("union_tag_invalid", "union_tag_not_found"):  # the tag itself: `role` or `type`
        ctx = error.get("ctx") or {}
        path += "." + str(ctx.get("discriminator", "type")).strip("'")
        if kind == "union_tag_not_found":
            return InvalidRequestError(path, "is required")
        expected = " or ".join(str(ctx.get("expected_tags")).rsplit(", ", 1))
        return InvalidRequestError(path, f"must be {expected}, got {quoted(ctx.get('tag'))}")
    return InvalidRequestError(path, describe(error))


@dataclass(frozen=True)
class LogprobView:
    """What an answer shows beside the text (docs/api.md, "Log-probabilities")."""

    logprobs: bool = False  # each output token's: chat's choices[].logprobs.content, completions' legacy shape
    echo: bool = False  # completions: the prompt before the text (with logprobs, its tokens' first)
    prompt_logprobs: bool = False  # vLLM's choices[].prompt_logprobs


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed request: what to generate, and how to answer it."""

    args: GenerateArgs
    stream: bool = False
    include_usage: bool = False
    tools: ToolOutput | None = None
    view: LogprobView = LogprobView()


def validated(model: type[BaseModel], body: Any, refused: dict[str, str] = REFUSED) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid(exc, refused) from None


def _set(**values: Any) -> dict[str, Any]:
    return {name: value for name, value in values.items() if value is not None}


def format_constraints(request: CompletionRequest | ChatCompletionRequest) -> list[Constraint]:
    """Every constraint the body asks for through response_format, structured_outputs and guided_*, in that order."""
    found: list[Constraint] = []
    response_format = request.response_format
    if isinstance(response_format, ResponseFormatJsonObject):
        found.append(Constraint("json", JSON_OBJECT_SCHEMA, "response_format"))
    elif isinstance(response_format, ResponseFormatJsonSchema):
        schema = response_format.json_schema.schema_
        found.append(json_schema_constraint(schema if schema is not None else {}, "response_format"))
    structured = request.structured_outputs
    if structured is not None:
        given = [key for key in STRUCTURED_KEYS if getattr(structured, "json_" if key == "json" else key) is not None]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs", f"must set exactly one of {', '.join(STRUCTURED_KEYS)}"
                                                            f"{', got ' + ', '.join(given) if given else ''}")
        found.append(_constraint(given[0], getattr(structured, "json_" if given[0] == "json" else given[0]),
                                 f"structured_outputs.{given[0]}"))
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(request, f"guided_{key}")
        if value is not None:
            found.append(_constraint(key, value, f"guided_{key}"))
    if len(found) > 1:
        first, second = (c.field.split(".")[0] for c in found[:2])
        raise InvalidRequestError(second, f"cannot be combined with {first}: one constraint a request")
    return found


def _constraint(key: str, value: Any, field_name: str) -> Constraint:
    if key == "json":
        return json_schema_constraint(value, field_name)
    if key == "choice":
        return choice_constraint(value, field_name)
    if key == "json_object":
        if not value:
            raise InvalidRequestError(field_name, "must be true when set")
        return Constraint("json", JSON_OBJECT_SCHEMA, field_name)
    return Constraint(key, value, field_name)  # regex, grammar: the engine compiles them


def _tool_choice(request: ChatCompletionRequest, found: list[Constraint]) -> tuple[Constraint | None, str,
                                                                                   ToolOutput | None]:
    """The constraint, the tools for the chat template (JSON) and how to read the output, of a chat request
    (tool_calls.resolve_tools over the body's tools)."""
    choice = request.tool_choice
    function = choice.function.name if isinstance(choice, NamedToolChoice) else None
    tools = [tool.model_dump(by_alias=True, exclude_none=True) for tool in request.tools or []]
    return resolve_tools(tools, None if isinstance(choice, NamedToolChoice) else choice, found, function=function,
                         parallel=request.parallel_tool_calls is not False)


def chat_messages(request: ChatCompletionRequest) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """GenerateArgs.messages and message_extras of a chat: text parts joined, an assistant's tool_calls and a tool
    result's tool_call_id as each message's extras (() when no message has any)."""
    messages, extras = [], []
    for index, message in enumerate(request.messages):
        content = message.content if isinstance(message.content, str) or message.content is None else \
            "".join(part.text for part in message.content)
        calls = message.tool_calls if isinstance(message, ChatAssistantMessage) else None
        if not calls and not content:
            raise InvalidRequestError(f"messages[{index}].content", "must be non-empty (or the message carry "
                                                                    "tool_calls)")
        messages.append((message.role, content or ""))
        extras.append(message_extra([call.model_dump() for call in calls or ()],
                                    message.tool_call_id if isinstance(message, ChatToolMessage) else None))
    return tuple(messages), (tuple(extras) if any(extras) else ())


def logprob_fields(request: CompletionRequest | ChatCompletionRequest, max_tokens: int | None
                   ) -> tuple[dict[str, Any], LogprobView]:
    """SamplingParams' log-probability fields and what the answer shows, from OpenAI's and vLLM's parameters:
    completions' `logprobs` N and `echo`, chat's `logprobs` and `top_logprobs`, vLLM's `prompt_logprobs`."""
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs and not request.logprobs:  # 0 without logprobs changes nothing
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        count = (request.top_logprobs or 0) if request.logprobs else None
        echo = False
    else:
        count, echo = request.logprobs, bool(request.echo)
    if max_tokens == 0 and not echo:
        raise InvalidRequestError("max_tokens", "must be at least 1 (0 only with echo: the prompt scored, nothing "
                                                "generated)")
    wanted = [n for n in (request.prompt_logprobs, count if echo else None) if n is not None]
    prompt = max(wanted) if wanted else (0 if echo and max_tokens == 0 else None)
    return (_set(logprobs=count, prompt_logprobs=prompt, logprobs_mode=request.logprobs_mode),
            LogprobView(logprobs=count is not None, echo=echo, prompt_logprobs=request.prompt_logprobs is not None))


def _common(request: CompletionRequest | ChatCompletionRequest, defaults: ServerDefaults, max_tokens: int | None,
            request_id: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError("stream_options", "is only allowed with stream: true")
    defaults.check_model(request.model or "")
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    sampling = SamplingParams(**_set(
        temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, min_p=request.min_p,
        repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, seed=request.seed, max_tokens=max_tokens, stop=stop,
        ignore_eos=request.ignore_eos,
        logit_bias=logit_bias_pairs(request.logit_bias) if request.logit_bias is not None else None,
        **(logprobs or {})))
    spec = SpecParams(contract=request.contract or defaults.contract(sampling.temperature),
                      k=None if request.k in (None, "auto") else request.k, draft=request.draft or defaults.draft)
    return {"request_id": request_id, "sampling": sampling, "spec": spec, "n": request.n or 1}


def check_sizes(body: Any, limits: RequestLimits, chat: bool) -> None:
    """The counts of a body's lists that cost more the longer they are (stop strings, messages, a prompt's token
    ids), refused before the body is validated item by item (300,000 messages took pydantic 3 s)."""
    if not isinstance(body, dict):
        return
    stop, messages, prompt = body.get("stop"), body.get("messages"), body.get("prompt")
    if isinstance(stop, list) and len(stop) > limits.max_stop_strings:
        limits.check_stop(stop)
    if chat and isinstance(messages, list):
        limits.check_messages(len(messages))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequestError("prompt", f"longer than {MAX_PROMPT_CHARS} characters")
    if isinstance(prompt, list) and len(prompt) > limits.max_context:
        limits.check_prompt_ids(len(prompt))


def parse_request(body: Any, defaults: ServerDefaults, chat: bool, request_id: str | None = None) -> OpenAIRequest:
    """Validate an OpenAI body (already JSON-decoded); raises InvalidRequestError naming the parameter."""
    request_id = request_id or new_request_id()
    tool_output: ToolOutput | None = None
    check_sizes(body, defaults.limits, chat)
    if chat:
        request = validated(ChatCompletionRequest, body, REFUSED_CHAT)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        messages, extras = chat_messages(request)
        constraint, tools, tool_output = _tool_choice(request, format_constraints(request))
        fields, view = logprob_fields(request, max_tokens)
        args = GenerateArgs(messages=messages, message_extras=extras, tools=tools, chat=True, constraint=constraint,
                            **_common(request, defaults, max_tokens, request_id, fields))
    else:
        request = validated(CompletionRequest, body, REFUSED_COMPLETION)
        prompt = request.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        found = format_constraints(request)
        fields, view = logprob_fields(request, request.max_tokens)
        common = _common(request, defaults, request.max_tokens, request_id, fields)
        constraint = found[0] if found else None
        if isinstance(prompt, str):
            args = GenerateArgs(prompt_text=prompt, constraint=constraint, echo=view.echo, **common)
        else:
            args = GenerateArgs(prompt_token_ids=tuple(prompt), constraint=constraint, echo=view.echo, **common)
    defaults.limits.check(args)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return OpenAIRequest(args, stream=bool(request.stream), include_usage=include_usage, tools=tool_output, view=view)


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
    logprobs: list[RowLogprobs] = field(default_factory=list)
    prompt_logprobs: RowLogprobs | None = None
    prompt_token_ids: tuple[int, ...] = ()
    prompt_text: str = ""
    pieces: dict[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)

    def rows(self) -> RowLogprobs | None:
        return RowLogprobs.concat(self.logprobs) if self.logprobs else None


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
        if chunk.logprobs is not None:
            choice.logprobs.append(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            choice.prompt_logprobs = chunk.prompt_logprobs
        if item.prompt_token_ids:
            choice.prompt_token_ids, choice.prompt_text = item.prompt_token_ids, item.prompt_text or ""
        choice.pieces.update(item.pieces)
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


def openai_finish(reason: str | None, calls: int = 0, tools: ToolOutput | None = None) -> str | None:
    """OpenAI's finish_reason: "tool_calls" where the output ended with calls made (a named tool_choice: "stop")."""
    return "tool_calls" if ends_in_calls(reason, calls, tools) else OPENAI_FINISH.get(reason or "", reason)


def _chat_logprobs(token_ids: list[int], rows: RowLogprobs | None, pieces: Pieces) -> dict[str, Any]:
    return {"content": chat_logprobs(token_ids, rows, pieces) if rows is not None else [], "refusal": None}


def _completion_logprobs(token_ids: list[int], rows: RowLogprobs | None, pieces: Pieces, text_start: int,
                         prompt: tuple[tuple[int, ...], RowLogprobs | None] | None) -> dict[str, Any]:
    """The legacy shape; `prompt` (echo): the prompt's ids and rows, shown first when the rows came."""
    shown = None if prompt is None or prompt[1] is None else (prompt[0], prompt[1])
    if rows is None:
        rows = RowLogprobs(np.zeros(0, np.float32), np.zeros((0, 0), np.int32), np.zeros((0, 0), np.float32),
                           np.zeros(0, np.int32))
    return completion_logprobs(token_ids, rows, pieces, text_start, shown)


def _prompt_entry(choice: Choice, view: LogprobView) -> dict[str, Any]:
    if not view.prompt_logprobs or choice.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": vllm_prompt_logprobs(choice.prompt_token_ids, choice.prompt_logprobs, choice.pieces)}


def completion_body(request_id: str, model: str, collected: Collected, chat: bool,
                    tools: ToolOutput | None = None, view: LogprobView = LogprobView()) -> dict[str, Any]:
    """The whole answer; with `tools` (a chat with tools) each choice's output is read for tool calls."""
    choices = []
    for index in sorted(collected.choices):
        choice = collected.choices[index]
        finish = OPENAI_FINISH.get(choice.finish_reason or "", choice.finish_reason)
        rows = choice.rows()
        if chat:
            logprobs = _chat_logprobs(choice.token_ids, rows, choice.pieces) if view.logprobs else None
        else:
            prompt = (choice.prompt_token_ids, choice.prompt_logprobs) if view.echo else None
            start = len(choice.prompt_text) if view.echo else 0
            logprobs = _completion_logprobs(choice.token_ids, rows, choice.pieces, start, prompt) \
                if view.logprobs else None
        if chat and tools is not None:
            parsed = parse_tool_calls(choice.text)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.calls:
                message["tool_calls"] = [call.openai() for call in parsed.calls]
            choices.append({"index": index, "message": message, "logprobs": logprobs,
                            "finish_reason": openai_finish(choice.finish_reason, len(parsed.calls), tools),
                            **_prompt_entry(choice, view)})
        elif chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": choice.text},
                            "finish_reason": finish, "logprobs": logprobs, **_prompt_entry(choice, view)})
        else:
            text = choice.prompt_text + choice.text if view.echo else choice.text
            choices.append({"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs,
                            "token_ids": choice.token_ids, **_prompt_entry(choice, view)})
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": collected.usage(), "metrics": collected.metrics(),
            "specserve": collected.specserve()}


def sse_data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"  # ASCII-escaped JSON: one line


def _spec(item: IndexedChunk) -> dict[str, Any]:
    chunk = item.chunk
    spec = {"proposed": chunk.proposed, "accepted": chunk.accepted, "token_ids": chunk.token_ids,
            "offset": chunk.offset, "contract": item.contract}
    if chunk.finished:
        spec["stats"] = chunk.stats
    return spec


def _event(request_id: str, model: str, chat: bool, choice: dict[str, Any], spec: dict[str, Any] | None,
           include_usage: bool) -> str:
    event: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                             "created": int(time.time()), "model": model, "choices": [choice]}
    if spec is not None:
        event["specserve"] = spec
    if include_usage:
        event["usage"] = None  # as OpenAI: null on every chunk but the last
    return sse_data(event)


def chunk_logprobs(item: IndexedChunk, chat: bool, view: LogprobView, text_start: int) -> dict[str, Any] | None:
    """A chunk's `logprobs` (its tokens'; completions with echo: the prompt's first, on the first chunk) and, with
    vLLM's prompt_logprobs, its `prompt_logprobs` entry."""
    chunk = item.chunk
    if not view.logprobs:
        return None
    if chat:
        return _chat_logprobs(chunk.token_ids, chunk.logprobs, item.pieces)
    prompt = (item.prompt_token_ids, chunk.prompt_logprobs) if view.echo and item.prompt_token_ids else None
    return _completion_logprobs(chunk.token_ids, chunk.logprobs, item.pieces, text_start, prompt)


def _prompt_field(item: IndexedChunk, view: LogprobView) -> dict[str, Any]:
    rows = item.chunk.prompt_logprobs
    if not view.prompt_logprobs or rows is None:
        return {}
    return {"prompt_logprobs": vllm_prompt_logprobs(item.prompt_token_ids, rows, item.pieces)}


def sse_event(request_id: str, model: str, item: IndexedChunk, chat: bool, first: bool,
              include_usage: bool = False, view: LogprobView = LogprobView(), text_start: int = 0) -> str:
    """One chunk's event; `text_start`: where its text starts in the choice's text (completions' text_offset)."""
    chunk = item.chunk
    finish = OPENAI_FINISH.get(chunk.finish_reason or "", chunk.finish_reason) if chunk.finished else None
    logprobs = chunk_logprobs(item, chat, view, text_start)
    if chat:
        delta: dict[str, Any] = {"content": chunk.text_delta}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": item.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    else:
        text = (item.prompt_text or "") + chunk.text_delta if view.echo else chunk.text_delta
        choice = {"index": item.index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    return _event(request_id, model, chat, {**choice, **_prompt_field(item, view)}, _spec(item), include_usage)


class SSEWriter:
    """A request's SSE events, chunk by chunk. Without tools one event a chunk (sse_event); a chat with tools reads
    each choice's output as it streams (tool_calls.ToolCallStream): text outside calls as `delta.content`, a
    possible `<tool_call>` held back, each call as OpenAI streams one (its id, type and name with empty arguments,
    then its arguments), so a chunk makes one event or more (its `specserve` on the first, the finish_reason on the
    last)."""

    def __init__(self, request_id: str, model: str, chat: bool, include_usage: bool = False,
                 tools: ToolOutput | None = None, view: LogprobView = LogprobView()) -> None:
        self.request_id, self.model, self.chat, self.include_usage = request_id, model, chat, include_usage
        self.tools = tools if chat else None
        self.view = view
        self._started: set[int] = set()
        self._streams: dict[int, ToolCallStream] = {}
        self._offsets: dict[int, int] = {}  # completions: each choice's text so far (text_offset)

    def events(self, item: IndexedChunk) -> list[str]:
        first = item.index not in self._started
        self._started.add(item.index)
        if self.tools is None:
            if self.view.echo and item.prompt_text is not None:
                self._offsets[item.index] = self._offsets.get(item.index, 0) + len(item.prompt_text)
            start = self._offsets.get(item.index, 0)
            self._offsets[item.index] = start + sum(len(item.pieces[t][0]) for t in item.chunk.token_ids) \
                if self.view.logprobs else start
            return [sse_event(self.request_id, self.model, item, self.chat, first, self.include_usage, self.view,
                              start)]
        chunk = item.chunk
        stream = self._streams.setdefault(item.index, ToolCallStream())
        before = stream.calls
        found = stream.feed(chunk.text_delta) + (stream.finish() if chunk.finished else [])
        deltas: list[dict[str, Any]] = []
        for kind, value in found:
            if kind == "content":
                if deltas and set(deltas[-1]) == {"content"}:
                    deltas[-1]["content"] += value
                else:
                    deltas.append({"content": value})
            else:  # the call's index among the choice's calls
                deltas.append({"tool_calls": [{"index": before, "id": value.id, "type": "function",
                                               "function": {"name": value.name, "arguments": ""}}]})
                deltas.append({"tool_calls": [{"index": before, "function": {"arguments": value.arguments}}]})
                before += 1
        deltas = deltas or [{"content": ""}]
        if first:
            deltas[0] = {"role": "assistant", **deltas[0]}
        finish = openai_finish(chunk.finish_reason, stream.calls, self.tools) if chunk.finished else None
        logprobs = chunk_logprobs(item, True, self.view, 0)
        return [_event(self.request_id, self.model, True,
                       {"index": item.index, "delta": delta, "logprobs": logprobs if at == 0 else None,
                        "finish_reason": finish if at == len(deltas) - 1 else None,
                        **(_prompt_field(item, self.view) if at == 0 else {})},
                       _spec(item) if at == 0 else None, self.include_usage)
                for at, delta in enumerate(deltas)]


def usage_event(request_id: str, model: str, collected: Collected, chat: bool) -> str:
    """The last chunk with stream_options.include_usage: no choices, the request's token counts."""
    return sse_data({"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": int(time.time()), "model": model, "choices": [], "usage": collected.usage(),
                   "metrics": collected.metrics()})


SSE_DONE = "data: [DONE]\n\n"


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

