"""The OpenAI-compatible HTTP bodies as pydantic models: the request models ARE the parser's first step, so the
schema /openapi.json publishes is exactly what the server accepts (cluster/serving/openai_api.py parses with them).

Requests: strict types (no coercion: "5" is not an integer, true is not 1), every bound the server enforces
(max_tokens in [1, 8192], n in [1, 16], k in [0, 8] or "auto", top_p in (0, 1], ...), `null` meaning unset
(completions' max_tokens: absent is 16, null until the model ends, as vLLM),
and unknown fields allowed and ignored (`additionalProperties: true`), as OpenAI's own clients send fields a
server may not know. Parameters specserve does not implement are declared with the one value that changes
nothing (REFUSED: best_of 1, echo false, functions [], ...), so any other value is refused with a 400 naming the
parameter instead of being silently ignored.

Constrained decoding (docs/api.md, "Structured output and tool calls"): OpenAI's `response_format` (json_object,
json_schema), `logit_bias`, `tools` / `tool_choice` / `parallel_tool_calls` (chat only), vLLM's
`structured_outputs` (json, regex, choice, grammar, json_object; an unknown key is refused) and its older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; cluster/serving/openai_api.py turns them into the
request's Constraint and SamplingParams.logit_bias.

Responses: what cluster/serving/openai_api.py writes, including the SSE chunks (`CompletionChunk`,
`ChatCompletionChunk`) and the `specserve` extension (contract, draft tokens proposed/accepted, statistics).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, RootModel, WithJsonSchema
from pydantic_core import PydanticCustomError

from specserve_types.api import (
    CONTRACTS,
    LOGIT_BIAS_RANGE,
    MAX_CHOICES,
    MAX_ID_CHARS,
    MAX_K,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_TOKENS_LIMIT,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
)
from specserve_types.protocol import CHAT_ROLES, MAX_N, MAX_PROMPT_CHARS

INT64 = 1 << 63
COMPLETION_MAX_TOKENS = 16  # /v1/completions' max_tokens when absent: OpenAI's legacy completions' default, and vLLM's

# -- the parameters specserve refuses unless they carry the value that changes nothing ------------------
REFUSED: dict[str, str] = {
    "best_of": "is not supported by specserve (only 1)",
    "suffix": "is not supported by specserve (only an empty suffix)",
    "functions": "the deprecated function calling is not supported by specserve: use tools",
    "function_call": "the deprecated function calling is not supported by specserve (only \"none\"): use "
                     "tool_choice",
    "guided_whitespace_pattern": "is not supported by specserve (only null)",
    "audio": "audio output is not supported by specserve",
    "modalities": "audio output is not supported by specserve (only [\"text\"])",
    "prediction": "predicted outputs are not supported by specserve",
    "web_search_options": "web search is not supported by specserve",
}
# ... on /v1/chat/completions, the completions' echo
REFUSED_CHAT: dict[str, str] = {
    **REFUSED,
    "echo": "is only supported by /v1/completions (only false here)",
}
# ... and on /v1/completions, the chat's tool calling
REFUSED_COMPLETION: dict[str, str] = {
    **REFUSED,
    "tools": "tool calling is only supported by /v1/chat/completions",
    "tool_choice": "tool calling is only supported by /v1/chat/completions (only \"none\" here)",
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


# -- constrained decoding ------------------------------------------------------------------------------
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="[a-zA-Z0-9_-], 1 to 64 characters")]
SchemaObject = Annotated[dict[str, Any], Field(description="a JSON Schema")]
ChoiceList = Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_CHOICES)]
LOGIT_BIAS_KEY = r"^[0-9]{1,10}$"
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=LOGIT_BIAS_KEY)],
         Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]],
    Field(max_length=MAX_LOGIT_BIAS),
    WithJsonSchema({"type": "object", "maxProperties": MAX_LOGIT_BIAS, "additionalProperties": False,
                    "patternProperties": {LOGIT_BIAS_KEY: {"type": "number", "minimum": LOGIT_BIAS_RANGE[0],
                                                           "maximum": LOGIT_BIAS_RANGE[1]}}}),
]


class ResponseFormatText(Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(Strict):
    """Any JSON object (Constraint json '{"type": "object"}')."""

    type: Literal["json_object"]


class JsonSchemaFormat(Strict):
    name: FunctionName
    description: str | None = Field(None, description="accepted; not shown to the model")
    schema_: SchemaObject | None = Field(None, alias="schema", description="the output's JSON Schema; absent: any "
                                                                           "JSON value")
    strict: bool | None = Field(None, description="accepted: the schema is always enforced")


class ResponseFormatJsonSchema(Strict):
    """JSON matching `json_schema.schema` (Constraint json)."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
                           Field(discriminator="type")]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of its keys; any other key is refused."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: SchemaObject | str | None = Field(None, alias="json", description="a JSON Schema (object or JSON text)")
    regex: NonEmptyText | None = Field(None, description="the whole output matches it (Rust regex syntax)")
    choice: ChoiceList | None = Field(None, description="the output is one of these strings")
    grammar: NonEmptyText | None = Field(None, description="llguidance's Lark syntax (`start` rule; `%json {...}` "
                                                           "embeds a JSON Schema)")
    json_object: bool | None = Field(None, description="true: any JSON object")


class FunctionDefinition(Strict):
    name: FunctionName
    description: str | None = None
    parameters: SchemaObject | None = Field(None, description="the arguments' JSON Schema; absent: any object")
    strict: bool | None = Field(None, description="accepted: with tool_choice required or named, the arguments "
                                                  "always match `parameters`")


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
MAX_TOOLS = 128


class GenerationParams(Strict):
    """What /v1/completions and /v1/chat/completions share; defaults are specserve's (greedy) but for max_tokens,
    OpenAI's and vLLM's: a chat generates until the model ends the answer, a completion 16 tokens."""

    model: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = Field(
        None, description="the served model (GET /v1/models); empty or absent = the served model")
    stream: bool | None = Field(None, description="server-sent events, ending with `data: [DONE]`")
    stream_options: StreamOptions | None = Field(None, description="only with `stream: true`")
    n: Int(ge=1, le=MAX_N) | None = Field(None, description="completions to generate (default 1)")
    max_tokens: Int(ge=0, le=MAX_TOKENS_LIMIT) | None = Field(
        None, description="tokens to generate at most; unset: until the model ends the answer (EOS, a stop string), "
                          "at most what the context leaves beside the prompt; prompt + max_tokens must fit the context")
    stop: NonEmptyText | list[NonEmptyText] | None = Field(None, description="stop strings (not in the output)")
    seed: Int(ge=-INT64, le=INT64 - 1) | None = Field(
        None, description="sampling seed (completion i of n uses seed + i)")
    temperature: Annotated[float, Field(ge=0)] | None = Field(
        None, description=f"0 (the default) = greedy; otherwise at least {MIN_TEMPERATURE:g}")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    # specserve extensions
    top_k: Int(ge=0, le=MAX_TOP_K) | None = Field(None, description="specserve: 0 disables")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(None, description="specserve")
    repetition_penalty: Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])] | None \
        = Field(None, description="specserve: 1 disables")
    ignore_eos: bool | None = Field(None, description="specserve: generate past end-of-sequence")
    contract: Literal[CONTRACTS] | None = Field(  # type: ignore[valid-type]
        None, description="specserve: acceptance contract; default greedy at temperature 0, else exact")
    k: Int(ge=0, le=MAX_K) | Literal["auto"] | None = Field(
        None, description="specserve: draft tokens per round (0 = plain decoding); default auto")
    draft: Literal["model", "ngram", "suffix", "none"] | None = Field(None, description="specserve: who drafts")
    # constrained decoding
    logit_bias: LogitBias | None = Field(
        None, description="token id (a string of digits) -> bias in [-100, 100] added to its logit (OpenAI's)")
    response_format: ResponseFormat | None = Field(
        None, description="text (the default), json_object, or json_schema")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: one of json, regex, choice, grammar, json_object; not with response_format")
    guided_json: SchemaObject | str | None = Field(None, description="vLLM's older structured_outputs.json")
    guided_regex: NonEmptyText | None = Field(None, description="vLLM's older structured_outputs.regex")
    guided_choice: ChoiceList | None = Field(None, description="vLLM's older structured_outputs.choice")
    guided_grammar: NonEmptyText | None = Field(None, description="vLLM's older structured_outputs.grammar")
    guided_decoding_backend: str | None = Field(None, description="accepted; specserve's grammar engine is "
                                                                  "llguidance")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call (default true)")
    # log-probabilities (docs/api.md, "Log-probabilities")
    prompt_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description="vLLM's: the prompt tokens' log-probabilities with this many top alternatives each")
    logprobs_mode: Literal["raw", "processed"] | None = Field(
        None, description="specserve: raw (the default: the target's log-softmax of its logits) or processed (of the "
                          "distribution the token was sampled from)")
    # refused unless harmless
    guided_whitespace_pattern: None = Field(None, description="refused")
    functions: Empty | None = Field(None, description="refused")
    function_call: only("none") | None = Field(None, description="refused")
    audio: None = Field(None, description="refused")
    modalities: list[Literal["text"]] | None = Field(None, description="refused")
    prediction: None = Field(None, description="refused")
    web_search_options: None = Field(None, description="refused")
    best_of: only(1) | None = Field(None, description="refused")
    suffix: only("") | None = Field(None, description="refused")


class CompletionRequest(GenerationParams):
    prompt: (Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | TokenIds
             | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]],
                         Field(min_length=1, max_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]) = Field(
        description="text, token ids, or a batch of one of these")
    max_tokens: Int(ge=0, le=MAX_TOKENS_LIMIT) | None = Field(
        COMPLETION_MAX_TOKENS, description=f"tokens to generate at most (default {COMPLETION_MAX_TOKENS}, OpenAI's and "
        "vLLM's); null: until the model ends the answer, at most what the context leaves beside the prompt (vLLM); "
        "prompt + max_tokens must fit the context; 0 only with echo (the prompt scored, nothing generated)")
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description="each token's log-probability with this many top alternatives (0: none)")
    echo: bool | None = Field(None, description="the prompt before the completion (with logprobs, its tokens' too)")
    tools: Empty | None = Field(None, description="refused: chat only")
    tool_choice: only("none") | None = Field(None, description="refused: chat only")


class TextPart(Strict):
    type: Literal["text"]
    text: str


Content = NonEmptyText | Annotated[list[TextPart], Field(min_length=1)]


class ChatSystemMessage(Strict):
    role: Literal["system"]
    content: Content = Field(description="text, or text parts (joined)")


class ChatUserMessage(Strict):
    role: Literal["user"]
    content: Content = Field(description="text, or text parts (joined)")


class FunctionCall(Strict):
    name: Annotated[str, Field(min_length=1)]
    arguments: str = Field(description="JSON text")


class ChatToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatAssistantMessage(Strict):
    role: Literal["assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = Field(
        None, description="text, or text parts (joined); may be empty or null only with tool_calls")
    tool_calls: Annotated[list[ChatToolCall], Field(min_length=1)] | None = Field(
        None, description="the calls this turn made")


class ChatToolMessage(Strict):
    role: Literal["tool"]
    content: Content = Field(description="a tool call's result")
    tool_call_id: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]


ChatMessage = Annotated[ChatSystemMessage | ChatUserMessage | ChatAssistantMessage | ChatToolMessage,
                        Field(discriminator="role")]
MESSAGE_MODELS: tuple[type[Strict], ...] = (ChatSystemMessage, ChatUserMessage, ChatAssistantMessage, ChatToolMessage)
assert {model.model_fields["role"].annotation.__args__[0] for model in MESSAGE_MODELS} == set(CHAT_ROLES)


class ChatCompletionRequest(GenerationParams):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="functions the model may call (Qwen2.5's <tool_call> format, read back into tool_calls)")
    tool_choice: ToolChoice | None = Field(
        None, description="none | auto (the default with tools) | required | a named function; required and named "
                          "constrain the output to calls whose arguments match the function's parameters")
    max_completion_tokens: Int(ge=1, le=MAX_TOKENS_LIMIT) | None = Field(
        None, description="as max_tokens (and preferred over it)")
    logprobs: bool | None = Field(None, description="each output token's log-probability in choices[].logprobs")
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = Field(
        None, description="with logprobs: this many likeliest alternatives at each position")
    echo: only(False) | None = Field(None, description="refused")


REQUEST_MODELS: tuple[type[Strict], ...] = (CompletionRequest, ChatCompletionRequest)


# -- responses ------------------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


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


class CompletionLogprobs(BaseModel):
    """/v1/completions' log-probabilities (OpenAI's legacy shape): per token its text, log-probability (null for a
    prompt's first token), top alternatives (text -> log-probability; null there too) and where its text starts in
    the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's UTF-8 bytes (a token may hold part of a character)")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


PromptLogprobs = list[dict[str, dict[str, Any]] | None]  # vLLM's: per prompt token, null for the first, else token
# id (a string) -> {logprob, rank, decoded_token} for the token itself and its top alternatives


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's, with prompt_logprobs")
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


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="JSON text")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the turn is tool calls only")
    tool_calls: list[ToolCallOut] | None = Field(None, description="with tools: the calls the output made")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's, with prompt_logprobs")


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
    logprobs: CompletionLogprobs | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's: on the choice's first chunk")


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


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A call as OpenAI streams it: its id, type and name with empty arguments, then its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's: on the choice's first chunk")


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
