"""The OpenAI-compatible HTTP bodies as pydantic models: the request models ARE the parser's first step, so the
schema /openapi.json publishes is exactly what the server accepts (cluster/serving/openai_api.py parses with them).

Requests: strict types (no coercion: "5" is not an integer, true is not 1), every bound the server enforces
(max_tokens in [1, 8192], n in [1, 16], k in [0, 8] or "auto", top_p in (0, 1], ...), `null` meaning unset,
and unknown fields allowed and ignored (`additionalProperties: true`), as OpenAI's own clients send fields a
server may not know. Parameters specserve does not implement are declared with the one value that changes
nothing (REFUSED: best_of 1, echo false, tool_choice "none", response_format {"type": "text"}, ...), so any other
value is refused with a 400 naming the parameter instead of being silently ignored.

Responses: what cluster/serving/openai_api.py writes, including the SSE chunks (`CompletionChunk`,
`ChatCompletionChunk`) and the `specserve` extension (contract, draft tokens proposed/accepted, statistics).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, RootModel, WithJsonSchema
from pydantic_core import PydanticCustomError

from specserve_types.api import (
    CONTRACTS,
    MAX_ID_CHARS,
    MAX_K,
    MAX_TOKENS_LIMIT,
    MIN_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
)
from specserve_types.protocol import CHAT_ROLES, MAX_N, MAX_PROMPT_CHARS

INT64 = 1 << 63

# -- the parameters specserve refuses unless they carry the value that changes nothing ------------------
REFUSED: dict[str, str] = {
    "best_of": "is not supported by specserve (only 1)",
    "echo": "is not supported by specserve (only false)",
    "suffix": "is not supported by specserve (only an empty suffix)",
    "logprobs": "log probabilities are not supported by specserve",
    "top_logprobs": "log probabilities are not supported by specserve",
    "logit_bias": "is not supported by specserve (only an empty object)",
    "tools": "tool calling is not supported by specserve",
    "tool_choice": "tool calling is not supported by specserve (only \"none\")",
    "functions": "function calling is not supported by specserve",
    "function_call": "function calling is not supported by specserve (only \"none\")",
    "response_format": "structured output is not supported by specserve (only {\"type\": \"text\"})",
    "audio": "audio output is not supported by specserve",
    "modalities": "audio output is not supported by specserve (only [\"text\"])",
    "prediction": "predicted outputs are not supported by specserve",
    "web_search_options": "web search is not supported by specserve",
}


def integral(value: Any) -> Any:
    """JSON has one number type: 3.0 is the integer 3 (as JSON Schema's `integer` says); 3.5 stays a float."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**bounds: int) -> Any:
    """A JSON integer within `bounds` (ge, le): 3.0 counts; strict otherwise ("3" and true are not integers)."""
    return Annotated[int, Field(**bounds), BeforeValidator(integral)]


def only(value: Any) -> Any:
    """The type of a refused parameter's one accepted value (strict: `true` is not 1, 0 is not `false`)."""
    kind = Int() if type(value) is int else type(value)

    def check(given: Any) -> Any:
        if given != value:
            raise PydanticCustomError("refused", "unsupported value")
        return given

    json_type = {bool: "boolean", int: "integer", str: "string"}[type(value)]
    return Annotated[kind, AfterValidator(check), WithJsonSchema({"type": json_type, "const": value})]


class Strict(BaseModel):
    """Request bodies: strict types, unknown fields ignored (and documented as allowed)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"additionalProperties": True})


Empty = Annotated[list[Any], Field(max_length=0)]
NonEmptyText = Annotated[str, Field(min_length=1)]
TokenId = Int(ge=0)
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class StreamOptions(Strict):
    include_usage: bool | None = Field(None, description="a last chunk before `data: [DONE]` with `choices: []` "
                                                         "and the request's `usage`")
    include_obfuscation: bool | None = Field(None, description="accepted; specserve pads nothing")


class ResponseFormatText(Strict):
    type: Literal["text"]


class GenerationParams(Strict):
    """What /v1/completions and /v1/chat/completions share; defaults are specserve's (greedy, 64 tokens)."""

    model: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = Field(
        None, description="the served model (GET /v1/models); empty or absent = the served model")
    stream: bool | None = Field(None, description="server-sent events, ending with `data: [DONE]`")
    stream_options: StreamOptions | None = Field(None, description="only with `stream: true`")
    n: Int(ge=1, le=MAX_N) | None = Field(None, description="completions to generate (default 1)")
    max_tokens: Int(ge=1, le=MAX_TOKENS_LIMIT) | None = Field(
        None, description="tokens to generate at most (default 64); prompt + max_tokens must fit the context")
    stop: NonEmptyText | list[NonEmptyText] | None = Field(None, description="stop strings (not in the output)")
    seed: Int(ge=-INT64, le=INT64 - 1) | None = Field(
        None, description="sampling seed (completion i of n uses seed + i)")
    temperature: Annotated[float, Field(ge=0)] | None = Field(
        None, description=f"0 (the default) = greedy; otherwise at least {MIN_TEMPERATURE:g}")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    # specserve extensions
    top_k: Int(ge=0) | None = Field(None, description="specserve: 0 disables")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(None, description="specserve")
    repetition_penalty: Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])] | None \
        = Field(None, description="specserve: 1 disables")
    ignore_eos: bool | None = Field(None, description="specserve: generate past end-of-sequence")
    contract: Literal[CONTRACTS] | None = Field(  # type: ignore[valid-type]
        None, description="specserve: acceptance contract; default greedy at temperature 0, else exact")
    k: Int(ge=0, le=MAX_K) | Literal["auto"] | None = Field(
        None, description="specserve: draft tokens per round (0 = plain decoding); default auto")
    draft: Literal["model", "ngram", "suffix", "none"] | None = Field(None, description="specserve: who drafts")
    # refused unless harmless
    logit_bias: Annotated[dict[str, Any], Field(max_length=0)] | None = Field(None, description="refused")
    tools: Empty | None = Field(None, description="refused")
    tool_choice: only("none") | None = Field(None, description="refused")
    parallel_tool_calls: bool | None = Field(None, description="accepted; no effect (no tools)")
    functions: Empty | None = Field(None, description="refused")
    function_call: only("none") | None = Field(None, description="refused")
    response_format: ResponseFormatText | None = Field(None, description="refused")
    audio: None = Field(None, description="refused")
    modalities: list[Literal["text"]] | None = Field(None, description="refused")
    prediction: None = Field(None, description="refused")
    web_search_options: None = Field(None, description="refused")
    best_of: only(1) | None = Field(None, description="refused")
    echo: only(False) | None = Field(None, description="refused")
    suffix: only("") | None = Field(None, description="refused")
    top_logprobs: only(0) | None = Field(None, description="refused")


class CompletionRequest(GenerationParams):
    prompt: (Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | TokenIds
             | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]],
                         Field(min_length=1, max_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]) = Field(
        description="text, token ids, or a batch of one of these")
    logprobs: only(0) | None = Field(None, description="refused")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: NonEmptyText | Annotated[list[TextPart], Field(min_length=1)] = Field(
        description="text, or text parts (joined)")


class ChatCompletionRequest(GenerationParams):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int(ge=1, le=MAX_TOKENS_LIMIT) | None = Field(
        None, description="as max_tokens (and preferred over it)")
    logprobs: only(False) | None = Field(None, description="refused")


REQUEST_MODELS: tuple[type[Strict], ...] = (CompletionRequest, ChatCompletionRequest)


# -- responses ------------------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "abort", "error"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeDecodingMetrics(BaseModel):
    """The request's speculation in vLLM's shape (all completions together): a spec step is a round that
    proposed drafts; mean acceptance length = 1 + accepted drafts per step; acceptance_histogram[i] = steps
    that accepted exactly i drafts."""

    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    draft_acceptance_rate: float
    mean_acceptance_length: float
    acceptance_histogram: list[int]


class ResponseMetrics(BaseModel):
    speculative_decoding: SpeculativeDecodingMetrics


class SpecserveInfo(BaseModel):
    """specserve's extension of a response: the contract used, draft tokens, per-choice statistics."""

    contract: str
    proposed: int
    accepted: int
    stats: list[dict[str, Any] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: None
    token_ids: list[int] = Field(description="specserve: the generated token ids")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    metrics: ResponseMetrics
    specserve: SpecserveInfo


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metrics: ResponseMetrics
    specserve: SpecserveInfo


class SpecserveChunkInfo(BaseModel):
    """specserve's extension of a chunk: this round's draft tokens and token ids; statistics on the last one."""

    proposed: int
    accepted: int
    token_ids: list[int]
    offset: int  # where token_ids start in the choice's output (tokens sent before this chunk)
    contract: str
    stats: dict[str, Any] | None = None


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: None


class CompletionChunk(BaseModel):
    """One SSE event of /v1/completions; with include_usage the last one has `choices: []` and `usage`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null, then set on the last chunk")
    metrics: ResponseMetrics | None = Field(None, description="on the include_usage chunk: the request's speculation")
    specserve: SpecserveChunkInfo | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: None


class ChatCompletionChunk(BaseModel):
    """One SSE event of /v1/chat/completions; with include_usage the last one has `choices: []` and `usage`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null, then set on the last chunk")
    metrics: ResponseMetrics | None = Field(None, description="on the include_usage chunk: the request's speculation")
    specserve: SpecserveChunkInfo | None = None


class ErrorDetail(BaseModel):
    message: str = Field(description="starts with the parameter's name when one is at fault")
    type: str = Field(description="invalid_request_error | capacity_error | unavailable_error | internal_error")
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    role: str
    draft: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: str


class StatsResponse(RootModel[dict[str, Any]]):
    """The scheduler's statistics (engine, KV, queue): a JSON object."""


STREAM_MODELS: tuple[type[BaseModel], ...] = (CompletionChunk, ChatCompletionChunk, ErrorResponse)
