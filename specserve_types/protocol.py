"""What travels between the ingress and the scheduler, and its conversion from/to the gRPC messages.

    client --GenerateRequest--> ingress --GenerateArgs--> scheduler --StreamItem...--> ingress --GenerateChunk-->

Errors cross the handle as values (`StreamError`), never as exceptions, so the ingress can map them
to exact status codes: invalid -> INVALID_ARGUMENT / HTTP 400, capacity -> RESOURCE_EXHAUSTED /
HTTP 429, internal -> INTERNAL / HTTP 500.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from specserve_types.api import (
    MAX_CHOICES,
    MAX_ID_CHARS,
    MAX_TOKENS_LIMIT,
    CapacityError,
    Constraint,
    InvalidRequestError,
    RowLogprobs,
    SamplingParams,
    SpecParams,
    SpecServeError,
    TokenChunk,
    check_identifier,
    check_text,
)
from specserve_types.proto import specserve_pb2 as pb
from specserve_types.tools import (
    FUNCTION_NAME,
    MAX_TOOLS,
    ToolCall,
    ToolOutput,
    message_extra,
    resolve_tools,
)

MAX_N = 16
MAX_PROMPT_CHARS = 1 << 20  # a cheap bound before tokenizing; the context length is checked after
CHAT_ROLES = ("system", "user", "assistant", "tool")  # "tool": a tool call's result (OpenAI's tool calling)

TIMEOUT_METADATA = "specserve-timeout-s"  # gRPC metadata: the call's time limit in seconds (cluster/serving/ingress.py)


@dataclass(frozen=True)
class GenerateArgs:
    """A validated generation request before tokenization (the prompt may still be text)."""

    request_id: str
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] = ()  # (role, content); chat only
    chat: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    spec: SpecParams = field(default_factory=SpecParams)
    n: int = 1
    constraint: Constraint | None = None  # what the output must match (each of the n completions on its own)
    # chat, tool calling (the chat template's input, OpenAI's shapes): per message "" or a JSON object of its keys
    # besides role and content (an assistant's `tool_calls`, a tool result's `tool_call_id`), or () for none; and
    # the JSON list of tool definitions the template shows the model ("" = none). cluster/serving/tool_calls.py
    message_extras: tuple[str, ...] = ()
    tools: str = ""
    trace_context: tuple[tuple[str, str], ...] = ()  # the front door's request span (specserve_types/tracing.py)
    # the prompt's ids and text on each completion's first chunk (OpenAI's echo; its log-probabilities are
    # sampling.prompt_logprobs')
    echo: bool = False
    # who sent it (set by the ingress, never by a client): an API key's id, or without keys the connection's
    # (cluster/serving/auth.py `client_id`), never the key itself; "" = unidentified. The scheduler's per-client
    # limits and the engine's fair order go by it (cluster/serving/client_shares.py)
    client: str = ""

    def __post_init__(self) -> None:
        check_identifier("request_id", self.request_id)
        check_identifier("client", self.client)
        if not (1 <= self.n <= MAX_N):
            raise InvalidRequestError("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.chat:
            if self.prompt_token_ids is not None:
                raise InvalidRequestError("prompt", "chat requests take text or messages, not token ids")
            if not self.messages:
                raise InvalidRequestError("messages", "a chat request needs at least one message")
            if self.message_extras and len(self.message_extras) != len(self.messages):
                raise InvalidRequestError("messages", "message_extras must hold one entry per message")
            extras = self.message_extras or ("",) * len(self.messages)
            for index, (role, content) in enumerate(self.messages):
                if role not in CHAT_ROLES:
                    raise InvalidRequestError(f"messages[{index}].role", f"must be one of {CHAT_ROLES}, got {role!r}")
                if not content and not extras[index]:  # an assistant's tool calls may come without text
                    raise InvalidRequestError(f"messages[{index}].content", "must be non-empty")
                check_text(f"messages[{index}].content", content)
                check_text(f"messages[{index}]", extras[index])
            check_text("tools", self.tools)
            if sum(len(content) for _, content in self.messages) + sum(map(len, extras)) + len(self.tools) \
                    > MAX_PROMPT_CHARS:
                raise InvalidRequestError("messages", f"longer than {MAX_PROMPT_CHARS} characters in all")
        elif self.tools or self.message_extras:
            raise InvalidRequestError("tools", "tools need a chat request")
        elif self.prompt_token_ids is not None:
            if not self.prompt_token_ids:
                raise InvalidRequestError("prompt", "must be non-empty")
            if any(token < 0 for token in self.prompt_token_ids):
                raise InvalidRequestError("prompt", "token ids must be >= 0")
        elif not self.prompt_text:
            raise InvalidRequestError("prompt", "must be non-empty")
        if self.prompt_text is not None:
            if len(self.prompt_text) > MAX_PROMPT_CHARS:
                raise InvalidRequestError("prompt", f"longer than {MAX_PROMPT_CHARS} characters")
            check_text("prompt", self.prompt_text)

    def completion_ids(self) -> list[str]:
        """Engine request ids of the n completions."""
        return [self.request_id] if self.n == 1 else [f"{self.request_id}#{index}" for index in range(self.n)]


@dataclass(frozen=True)
class StreamError:
    code: Literal["invalid", "capacity", "internal"]
    message: str
    field: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> StreamError:
        if isinstance(exc, InvalidRequestError):
            return cls("invalid", exc.message, exc.field)
        if isinstance(exc, CapacityError):
            return cls("capacity", str(exc) or "server is full")
        return cls("internal", f"{type(exc).__name__}: {exc}")

    def to_exception(self) -> SpecServeError:
        if self.code == "invalid":
            return InvalidRequestError(self.field or "request", self.message)
        if self.code == "capacity":
            return CapacityError(self.message)
        return SpecServeError(self.message)

    def describe(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


@dataclass(frozen=True)
class IndexedChunk:
    """One chunk of completion `index` of a request (n > 1 interleaves completions).

    `chunk.request_id` is the client's request id (not the engine's per-completion id). `tool_calls`: gRPC only,
    a request with tools: the calls this chunk's text completed (GenerateChunk.tool_calls); the scheduler sends none.
    """

    index: int
    chunk: TokenChunk
    contract: str
    tool_calls: tuple[ToolCall, ...] = ()
    # with log-probabilities: the text and bytes of every token id they name (cluster/serving/token_pieces.py)
    pieces: Mapping[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    # echo, on each completion's first chunk: the prompt's ids and text
    prompt_token_ids: tuple[int, ...] = ()
    prompt_text: str | None = None


StreamItem = IndexedChunk | StreamError


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True)
class RequestLimits:
    """The most one request may ask of this server, where its cost grows with a field's size: refused at the front
    doors (INVALID_ARGUMENT / HTTP 400 naming the field) before anything is reserved or tokenized. The server's
    policy: ClusterConfig's fields of these names (cluster/serving/config.py; docs/api.md, "Limits"). The bounds of
    every server (MAX_PROMPT_CHARS, MAX_N, api.MAX_LOGIT_BIAS, ...) are checked where the fields are read."""

    max_context: int = 1 << 20  # a prompt of token ids: its ids + max_tokens at most this many
    max_stop_strings: int = 64
    max_stop_string_chars: int = 256  # each
    max_stop_chars: int = 4096  # all of a request's together
    max_messages: int = 2048
    max_request_tokens: int = 16384  # n x max_tokens (an unset max_tokens is resolved within it: the scheduler)

    def check_stop(self, stop: Sequence[str]) -> None:
        """Stop strings: how many, how long each, and in all (the automaton that matches them grows with them)."""
        if len(stop) > self.max_stop_strings:
            raise InvalidRequestError("stop", f"at most {self.max_stop_strings} stop strings, got {len(stop)}")
        longest = max(map(len, stop), default=0)
        if longest > self.max_stop_string_chars:
            raise InvalidRequestError("stop", f"each stop string at most {self.max_stop_string_chars} characters, "
                                              f"got one of {longest}")
        total = sum(map(len, stop))
        if total > self.max_stop_chars:
            raise InvalidRequestError("stop", f"at most {self.max_stop_chars} characters of stop strings in all, "
                                              f"got {total}")

    def check_messages(self, count: int) -> None:
        if count > self.max_messages:
            raise InvalidRequestError("messages", f"at most {self.max_messages} messages, got {count}")

    def check_prompt_ids(self, count: int, max_tokens: int | None = 0) -> None:
        """A prompt of token ids longer than the context can hold (the engine checks the model's own context); an
        unset max_tokens (None) asks for one token at least."""
        if max_tokens is None and count >= self.max_context:
            raise InvalidRequestError("prompt", f"prompt ({count} tokens) leaves no room to generate in the context "
                                                f"of {self.max_context} tokens")
        if max_tokens is not None and count + max_tokens > self.max_context:
            raise InvalidRequestError("prompt", f"prompt ({count} tokens) + max_tokens ({max_tokens}) exceeds the "
                                                f"context of {self.max_context} tokens" if max_tokens else
                                                f"prompt ({count} tokens) exceeds the context of {self.max_context} "
                                                "tokens")

    def check_tokens(self, n: int, max_tokens: int | None) -> None:
        """The tokens a request may generate in all (n completions of max_tokens each; unset: resolved within it)."""
        if max_tokens is not None and n * max_tokens > self.max_request_tokens:
            raise InvalidRequestError("max_tokens" if n == 1 else "n",
                                      f"n ({n}) x max_tokens ({max_tokens}) = {n * max_tokens} exceeds the "
                                      f"{self.max_request_tokens} tokens a request may generate on this server")

    def check(self, args: GenerateArgs) -> None:
        """Every limit of a parsed request (each door also checks the counts before it builds the request)."""
        self.check_stop(args.sampling.stop)
        self.check_messages(len(args.messages))
        if args.prompt_token_ids is not None:
            self.check_prompt_ids(len(args.prompt_token_ids), args.sampling.max_tokens)
        self.check_tokens(args.n, args.sampling.max_tokens)


@dataclass(frozen=True)
class ServerDefaults:
    """What an unset request field means on this server, and what a request may ask of it."""

    model: str  # the served target
    draft: str = "model"  # SpecParams.draft for requests that name none: "model", or "ngram" without a draft model
    limits: RequestLimits = field(default_factory=RequestLimits)

    def check_model(self, requested: str) -> None:
        if requested:
            check_identifier("model", requested)
        if requested and requested != self.model:
            raise InvalidRequestError("model", f"unknown model {requested!r}; this server serves {self.model!r}")

    @staticmethod
    def contract(temperature: float) -> str:
        """Unset contract: greedy at temperature 0, exact otherwise (as `specserve generate`)."""
        return "greedy" if temperature == 0 else "exact"


JSON_OBJECT_SCHEMA = '{"type": "object"}'  # OpenAI's json_object: any JSON object


def choice_constraint(choices: Sequence[str], field_name: str = "choice") -> Constraint:
    """The `choice` constraint of a list of strings (its value is their JSON list)."""
    if isinstance(choices, str) or not isinstance(choices, Sequence):
        raise InvalidRequestError(field_name, f"must be a list of strings, got {type(choices).__name__}")
    if not choices:
        raise InvalidRequestError(field_name, "needs at least one choice")
    if len(choices) > MAX_CHOICES:
        raise InvalidRequestError(field_name, f"at most {MAX_CHOICES} choices, got {len(choices)}")
    for index, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise InvalidRequestError(field_name, f"choice {index} must be a non-empty string, got {choice!r}")
    return Constraint("choice", json.dumps(list(choices), ensure_ascii=False), field_name)


def json_schema_constraint(schema: str | Mapping[str, Any] | bool, field_name: str = "json_schema") -> Constraint:
    """The `json` constraint of a JSON Schema, given as JSON text or as the parsed object; the text must parse
    (whether the schema compiles is the engine's to say, at submit)."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(field_name, f"is not valid JSON: {exc}") from None
        text = schema
    else:
        parsed, text = schema, json.dumps(schema, ensure_ascii=False)
    if not isinstance(parsed, (dict, bool)):
        raise InvalidRequestError(field_name, f"a JSON Schema is an object (or true/false), got {type(parsed).__name__}")
    return Constraint("json", text, field_name)


def logit_bias_pairs(bias: Mapping[Any, Any] | Iterable[tuple[Any, Any]], field_name: str = "logit_bias",
                     ) -> tuple[tuple[int, float], ...]:
    """SamplingParams.logit_bias from {token id: bias} or (id, bias) pairs: ids as integers (JSON's string keys
    too), sorted, unique; SamplingParams checks the bounds."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    pairs: dict[int, float] = {}
    for key, value in items:
        token = int(key) if isinstance(key, str) and key.isascii() and key.lstrip("-").isdigit() else key
        if type(token) is not int:
            raise InvalidRequestError(field_name, f"token ids must be integers, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequestError(field_name, f"bias of token {token} must be a finite number, got {value!r}")
        if token in pairs:
            raise InvalidRequestError(field_name, f"token {token} given twice")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar")  # pb.Constraint's oneof


def constraint_from_proto(message: pb.Constraint) -> Constraint | None:
    """A GenerateRequest's `constraint` (None when no kind is set); errors name `constraint.KIND`."""
    which = message.WhichOneof("kind")
    if which is None:
        return None
    name = f"constraint.{which}"
    if which == "json_schema":
        return json_schema_constraint(message.json_schema, name)
    if which == "json_object":
        if not message.json_object:
            raise InvalidRequestError(name, "must be true when set (leave the constraint unset for free text)")
        return Constraint("json", JSON_OBJECT_SCHEMA, name)
    if which == "choice":
        return choice_constraint(list(message.choice.choices), name)
    value = getattr(message, which)  # regex, grammar: the engine compiles them
    if not value:
        raise InvalidRequestError(name, "must be non-empty")
    return Constraint(which, value, name)


def constraint_to_proto(constraint: Constraint) -> pb.Constraint:
    if constraint.kind == "json":
        return pb.Constraint(json_schema=constraint.value)
    if constraint.kind == "choice":
        return pb.Constraint(choice=pb.Choices(choices=json.loads(constraint.value)))
    return pb.Constraint(**{constraint.kind: constraint.value})


MAX_QUOTED_CHARS = 60  # a refused value quoted back to the client, shortened (as the HTTP door's)


def _quoted(value: str) -> str:
    text = ascii(value)  # escaped: one line
    return text if len(text) <= MAX_QUOTED_CHARS else text[:MAX_QUOTED_CHARS] + "..."


def tools_from_proto(tools: Sequence[pb.Tool]) -> list[dict[str, Any]]:
    """A GenerateRequest's `tools` as OpenAI's dicts ({"type": "function", "function": {"name", "description",
    "parameters"}}, empty fields left out: what the HTTP door dumps of the same tools); errors name `tools[i].FIELD`."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"must hold at most {MAX_TOOLS} items, got {len(tools)}")
    out: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        if not FUNCTION_NAME.fullmatch(tool.name):
            raise InvalidRequestError(f"tools[{index}].name", f"must be 1 to 64 of [a-zA-Z0-9_-], got "
                                                              f"{_quoted(tool.name)}")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters_json:
            try:
                parameters = json.loads(tool.parameters_json)
            except ValueError as exc:
                raise InvalidRequestError(f"tools[{index}].parameters_json", f"is not valid JSON: {exc}") from None
            if not isinstance(parameters, dict):
                raise InvalidRequestError(f"tools[{index}].parameters_json", f"must be a JSON Schema object, got "
                                                                             f"{type(parameters).__name__}")
            function["parameters"] = parameters
        out.append({"type": "function", "function": function})
    return out


def messages_from_proto(messages: Sequence[pb.ChatMessage]) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """GenerateArgs.messages and message_extras of a request's `messages` (the extras as the HTTP door makes them
    for the same conversation: tools.message_extra; () when no message has any); errors name `messages[i].FIELD`."""
    out, extras = [], []
    for index, message in enumerate(messages):
        name = f"messages[{index}]"
        if message.role not in CHAT_ROLES:
            raise InvalidRequestError(f"{name}.role", f"must be one of {CHAT_ROLES}, got {message.role!r}")
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequestError(f"{name}.tool_calls", "only an assistant message carries tool_calls")
        for at, call in enumerate(message.tool_calls):
            if not call.name:
                raise InvalidRequestError(f"{name}.tool_calls[{at}].name", "must be non-empty")
        if message.role == "tool":
            if not message.tool_call_id:
                raise InvalidRequestError(f"{name}.tool_call_id", "is required (the id of the call this is the "
                                                                  "result of)")
            if len(message.tool_call_id) > MAX_ID_CHARS:
                raise InvalidRequestError(f"{name}.tool_call_id", f"longer than {MAX_ID_CHARS} characters")
            if not message.content:
                raise InvalidRequestError(f"{name}.content", "must be non-empty")
        elif message.tool_call_id:
            raise InvalidRequestError(f"{name}.tool_call_id", "only a tool message carries tool_call_id")
        calls = [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                 for call in message.tool_calls]
        out.append((message.role, message.content))
        extras.append(message_extra(calls, message.tool_call_id if message.role == "tool" else None))
    return tuple(out), (tuple(extras) if any(extras) else ())


def tool_choice_from_proto(request: pb.GenerateRequest) -> tuple[str | None, str | None]:
    """(mode, function) of a request's tool_choice: (None, None) unset."""
    which = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if which == "mode":
        return request.tool_choice.mode, None
    if which == "function":
        return None, request.tool_choice.function
    return None, None


def request_from_proto(request: pb.GenerateRequest, defaults: ServerDefaults) -> tuple[GenerateArgs,
                                                                                      ToolOutput | None]:
    """Validate a gRPC GenerateRequest: its GenerateArgs, and how to read its output for tool calls (None: a request
    without tools, or tool_choice "none"); raises InvalidRequestError naming the field."""
    defaults.check_model(request.model)

    def opt(name: str, default: float | int | None) -> float | int | None:
        return getattr(request, name) if request.HasField(name) else default

    base = SamplingParams()
    max_tokens = request.max_tokens if request.HasField("max_tokens") else None  # unset: until the model ends
    lowest = 0 if request.echo else 1  # 0: the prompt scored, nothing generated
    if max_tokens is not None and not (lowest <= max_tokens <= MAX_TOKENS_LIMIT):  # before the int32 reaches anything
        raise InvalidRequestError("max_tokens", f"must be in [{lowest}, {MAX_TOKENS_LIMIT}]"
                                                f"{'' if lowest else ' (0 only with echo)'}, got {max_tokens}")
    limits = defaults.limits  # the sizes first, before anything is built of them
    limits.check_stop(request.stop)
    limits.check_messages(len(request.messages) + (1 if request.chat and request.WhichOneof("prompt") == "text"
                                                   else 0))
    if request.WhichOneof("prompt") == "token_ids":
        limits.check_prompt_ids(len(request.token_ids.ids), max_tokens)
    logprobs = opt("logprobs", None)
    sampling = SamplingParams(
        temperature=float(opt("temperature", base.temperature)),
        top_k=int(opt("top_k", base.top_k)),
        top_p=float(opt("top_p", base.top_p)),
        min_p=float(opt("min_p", base.min_p)),
        repetition_penalty=float(opt("repetition_penalty", base.repetition_penalty)),
        presence_penalty=float(opt("presence_penalty", base.presence_penalty)),
        frequency_penalty=float(opt("frequency_penalty", base.frequency_penalty)),
        seed=opt("seed", None),
        max_tokens=max_tokens,
        stop=tuple(request.stop),
        ignore_eos=request.ignore_eos,
        logit_bias=logit_bias_pairs(request.logit_bias),
        logprobs=None if logprobs is None else int(logprobs),
        prompt_logprobs=int(logprobs or 0) if request.echo else None,
        logprobs_mode=request.logprobs_mode or "raw",
    )
    spec = SpecParams(
        contract=request.contract or defaults.contract(sampling.temperature),
        k=opt("k", None),
        draft=request.draft or defaults.draft,
    )
    which = request.WhichOneof("prompt")
    if request.messages and not request.chat:
        raise InvalidRequestError("messages", "messages need chat=true")
    messages, extras = messages_from_proto(request.messages)
    if request.chat and which == "text":
        messages = (*messages, ("user", request.text))
        extras = (*extras, "") if extras else ()
    if request.tools and not request.chat:
        raise InvalidRequestError("tools", "tools need chat=true")
    constraint = constraint_from_proto(request.constraint) if request.HasField("constraint") else None
    mode, function = tool_choice_from_proto(request)
    resolved = resolve_tools(tools_from_proto(request.tools), mode, [constraint] if constraint else [],
                             function=function, parallel=opt("parallel_tool_calls", True) is not False,
                             name_field="tools[{}].name")
    args = GenerateArgs(
        request_id=request.request_id or new_request_id(),
        prompt_text=request.text if which == "text" and not request.chat else None,
        prompt_token_ids=tuple(request.token_ids.ids) if which == "token_ids" else None,
        messages=messages,
        message_extras=extras,
        tools=resolved.definitions,
        chat=request.chat,
        sampling=sampling,
        spec=spec,
        n=int(opt("n", 1)),
        constraint=resolved.constraint,
        echo=request.echo,
    )
    limits.check(args)
    return args, resolved.output


def args_from_proto(request: pb.GenerateRequest, defaults: ServerDefaults) -> GenerateArgs:
    """Validate a gRPC GenerateRequest; raises InvalidRequestError naming the field (request_from_proto)."""
    return request_from_proto(request, defaults)[0]


def chunk_to_proto(item: IndexedChunk) -> pb.GenerateChunk:
    chunk = item.chunk
    return pb.GenerateChunk(
        request_id=chunk.request_id,
        index=item.index,
        token_ids=chunk.token_ids,
        text_delta=chunk.text_delta,
        proposed=chunk.proposed,
        accepted=chunk.accepted,
        forced=chunk.forced,
        finish_reason=chunk.finish_reason or "",
        stats_json=json.dumps(chunk.stats, sort_keys=True, default=str) if chunk.stats is not None else "",
        contract=item.contract,
        offset=chunk.offset,
        tool_calls=[pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments) for call in item.tool_calls],
        logprobs=_logprobs_to_proto(chunk.token_ids, chunk.logprobs, item.pieces),
        prompt_logprobs=_logprobs_to_proto(item.prompt_token_ids[1:], chunk.prompt_logprobs, item.pieces),
        prompt_token_ids=item.prompt_token_ids,
        prompt_text=item.prompt_text or "",
    )


def _logprobs_to_proto(token_ids: Sequence[int], rows: RowLogprobs | None,
                       pieces: Mapping[int, tuple[str, tuple[int, ...]]]) -> list[pb.TokenLogprob]:
    if rows is None:
        return []

    def piece(token: int) -> tuple[str, bytes]:
        text, data = pieces.get(token, ("", ()))
        return text, bytes(data)

    out = []
    for token, (logprob, top), rank in zip(token_ids, rows.entries(), rows.ranks.tolist(), strict=True):
        text, data = piece(token)
        out.append(pb.TokenLogprob(token_id=token, token=text, logprob=logprob, bytes=data, rank=rank, top_logprobs=[
            pb.TopLogprob(token_id=t, token=piece(t)[0], logprob=lp, bytes=piece(t)[1]) for t, lp in top]))
    return out


def _logprobs_from_proto(entries: Sequence[pb.TokenLogprob]) -> tuple[RowLogprobs | None,
                                                                      dict[int, tuple[str, tuple[int, ...]]]]:
    """The rows and the pieces they name, from a chunk's TokenLogprob entries (None: none sent)."""
    if not entries:
        return None, {}
    width = len(entries[0].top_logprobs)
    pieces: dict[int, tuple[str, tuple[int, ...]]] = {}
    for entry in entries:
        pieces[entry.token_id] = (entry.token, tuple(entry.bytes))
        for top in entry.top_logprobs:
            pieces[top.token_id] = (top.token, tuple(top.bytes))
    rows = RowLogprobs(
        np.array([e.logprob for e in entries], np.float32),
        np.array([[t.token_id for t in e.top_logprobs] for e in entries], np.int32).reshape(len(entries), width),
        np.array([[t.logprob for t in e.top_logprobs] for e in entries], np.float32).reshape(len(entries), width),
        np.array([e.rank for e in entries], np.int32))
    return rows, pieces


def chunk_from_proto(message: pb.GenerateChunk) -> IndexedChunk:
    chunk = TokenChunk(
        request_id=message.request_id,
        token_ids=list(message.token_ids),
        text_delta=message.text_delta,
        proposed=message.proposed,
        accepted=message.accepted,
        forced=message.forced,
        finish_reason=message.finish_reason or None,  # type: ignore[arg-type]
        stats=json.loads(message.stats_json) if message.stats_json else None,
        offset=message.offset,
    )
    logprobs, pieces = _logprobs_from_proto(message.logprobs)
    prompt_logprobs, prompt_pieces = _logprobs_from_proto(message.prompt_logprobs)
    chunk = dataclasses.replace(chunk, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    calls = tuple(ToolCall(call.name, call.arguments, call.id) for call in message.tool_calls)
    return IndexedChunk(index=message.index, chunk=chunk, contract=message.contract, tool_calls=calls,
                        pieces={**pieces, **prompt_pieces}, prompt_token_ids=tuple(message.prompt_token_ids),
                        prompt_text=message.prompt_text or None)
