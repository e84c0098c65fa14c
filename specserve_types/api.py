"""Public request/response types shared by the in-process engine, the Ray Serve cluster and the gRPC/HTTP APIs.

Glossary:
  contract    the acceptance rule of a speculative round: "exact" (output distribution equals the
              target's), "greedy" (output equals plain greedy target decoding), "typical" (relaxed,
              changes the distribution; labeled in every output).
  k           number of draft tokens proposed per round; "auto" lets the policy choose (0 = plain decode).
  chunk       what one round emits for one request: zero or more accepted draft tokens plus one
              correction or bonus token, cut at a stop condition.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Contract = Literal["exact", "greedy", "typical"]
CONTRACTS: tuple[str, ...] = ("exact", "greedy", "typical")
# the exact contract's rules for a sampled chain (verifier_service/contracts.py): block verification (Sun et al.
# 2024), the default, or token by token (Leviathan et al. 2023); a server setting (ClusterConfig.exact_rule)
ExactRule = Literal["block", "token"]
EXACT_RULES: tuple[str, ...] = ("block", "token")
# see model_runtime.precision; q4: the GGUF's own quantized linears (model_runtime/quant_weights.py)
DRAFT_DTYPES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16", "int8", "q4")
TARGET_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "q4")  # model_runtime.precision.target_dtype
TARGET_AUTO = ("q4 (the GGUF's own 4-bit codes) for a known model on one CPU rank where the AMX kernels do not "
               "run, and with AMX for an engine of one request at a time (max_batch 1); else bfloat16 on CUDA and wherever our batch-invariant CPU kernels run (AMX, AVX-512, AVX2: "
               "docs/exactness.md); float32 under SPECSERVE_CPU_KERNEL=torch on CPUs without bf16 instructions")
DRAFT_AUTO = ("int8 on CPUs with AMX, q4 where the target's auto is q4, bfloat16 on CUDA and where the target's "
              "auto is bfloat16, float16 on the rest")  # what model_runtime.precision's target_dtype /
# draft_dtype("auto", ...) pick, for the help
FinishReason = Literal["stop", "length", "eos", "abort", "error"]
MAX_TOKENS_LIMIT = 8192
MIN_TEMPERATURE = 1e-3  # below it, logits / temperature overflows float32: 0 (greedy) or at least this
REPETITION_PENALTY_RANGE = (1e-2, 1e2)  # the same overflow, the other way round
MAX_K = 8
MAX_TOP_K = (1 << 31) - 1  # gRPC's int32; the round messages carry it as a MessagePack integer
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: added to the raw logits; -100 bans a token, 100 all but forces it
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias (OpenAI allows 300; vLLM no bound)
MAX_LOGPROBS = 20  # top alternatives reported per token (OpenAI's top_logprobs bound)
LOGPROBS_MODES = ("raw", "processed")  # the target's raw logits' log-softmax, or the sampled-from distribution's
CONSTRAINT_KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar")
MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema, regex, grammar or the choices' JSON: larger is refused (docs/api.md)
MAX_CHOICES = 256


class SpecServeError(Exception):
    """Base class of every error a user of specserve can see."""


class InvalidRequestError(SpecServeError, ValueError):
    """Bad input; `field` names the offending request field (gRPC INVALID_ARGUMENT, HTTP 400)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message

    def __reduce__(self) -> tuple:  # crosses Ray process boundaries intact
        return (type(self), (self.field, self.message))


class CapacityError(SpecServeError, RuntimeError):
    """The server cannot take this request now (gRPC RESOURCE_EXHAUSTED, HTTP 429); `retry_after_s` is the
    server's hint (gRPC `retry-after` trailing metadata, HTTP Retry-After) when it sent one."""

    def __init__(self, message: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.retry_after_s))


MAX_ID_CHARS = 128  # request ids and model names are logged: short, printable, one line


def check_text(field_name: str, value: str) -> None:
    """Text a tokenizer can take: valid Unicode (no unpaired UTF-16 surrogate, which JSON's `\\ud800` escapes
    can produce and UTF-8 cannot encode). Control characters are allowed: prompts hold tabs and newlines."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(field_name, f"is not valid Unicode: unpaired surrogate {value[exc.start]!r} "
                                              f"at character {exc.start}") from None


def check_identifier(field_name: str, value: str) -> None:
    """An id that ends up in logs and headers: printable, one line, at most MAX_ID_CHARS characters."""
    check_text(field_name, value)
    if len(value) > MAX_ID_CHARS:
        raise InvalidRequestError(field_name, f"longer than {MAX_ID_CHARS} characters")
    if not value.isprintable():
        raise InvalidRequestError(field_name, "must be printable characters on one line")


@dataclass(frozen=True)
class Constraint:
    """What the output must match, compiled by the grammar engine (verifier_service/constraint.py, llguidance):

      json     `value` is a JSON Schema (JSON text); "{}" is any JSON value, '{"type": "object"}' any object
               (OpenAI's json_object)
      regex    `value` is a regular expression the whole output matches (llguidance's regex syntax)
      choice   `value` is a JSON list of strings: the output is exactly one of them
      grammar  `value` is a grammar in llguidance's Lark syntax (a `start` rule; `%json {...}` embeds a schema)

    Frozen and hashable: the compiled grammar is cached per constraint (kind and value: the same schema from two
    fields compiles once). `field` names the request field it came from (for the errors a bad one gets)."""

    kind: str
    value: str
    field: str = dataclasses.field(default="constraint", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError(self.field, f"unknown constraint kind {self.kind!r}; known: "
                                                  f"{', '.join(CONSTRAINT_KINDS)}")
        check_text(self.field, self.value)
        if len(self.value) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(self.field, f"longer than {MAX_CONSTRAINT_CHARS} characters")


@dataclass(frozen=True)
class SamplingParams:
    """The request's sampling transform, applied identically to target (p) and draft (q) logits."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1.0 = disabled (HF semantics, over prompt + output)
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    # None (unset): until the model ends the answer (EOS, a stop string) or the context ends it: the tokens the
    # context leaves beside the prompt, at most MAX_TOKENS_LIMIT; set once the prompt's length is known, where it is
    # tokenized (cluster/engine/request_state.py `resolve_max_tokens`), as OpenAI's chat and vLLM do
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # OpenAI's logit_bias: (token id, bias) pairs added to the raw logits before penalties (ids sorted, unique;
    # ids outside the vocabulary are refused at submit, where the vocabulary is known)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # log-probabilities (docs/api.md, "Log-probabilities"): each output token's, with this many top alternatives
    # (0..MAX_LOGPROBS); None: none. `prompt_logprobs` the same for the prompt's tokens (the first one has none);
    # with it, max_tokens may be 0 (the prompt scored, nothing generated). `logprobs_mode`: "raw" (the target's
    # log-softmax of its raw logits, the default, as OpenAI and vLLM) or "processed" (of the distribution the token
    # was sampled from: logit bias, penalties, constraint, temperature, top-k/top-p/min-p applied)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "raw"

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidRequestError("temperature", f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                                                     f"got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequestError("top_k", f"must be in [0, {MAX_TOP_K}] (0 disables), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:  # NaN fails too
            raise InvalidRequestError("repetition_penalty", f"must be in [{low:g}, {high:g}] (1 disables), "
                                                            f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(name, f"must be in [0, {MAX_LOGPROBS}] or unset, got {value!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequestError("logprobs_mode", f"must be one of {', '.join(LOGPROBS_MODES)}, "
                                                       f"got {self.logprobs_mode!r}")
        lowest = 0 if self.prompt_logprobs is not None else 1  # max_tokens 0 only scores the prompt
        if self.max_tokens is not None and not (lowest <= self.max_tokens <= MAX_TOKENS_LIMIT):
            raise InvalidRequestError("max_tokens", f"must be in [{lowest}, {MAX_TOKENS_LIMIT}]"
                                                    f"{' (0 only to score the prompt)' if not lowest else ''}, "
                                                    f"got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty")
        for stop in self.stop:
            check_text("stop", stop)
        low, high = LOGIT_BIAS_RANGE
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        ids = [token for token, _ in self.logit_bias]
        if ids != sorted(set(ids)):
            raise InvalidRequestError("logit_bias", "token ids must be unique (sorted)")
        for token, bias in self.logit_bias:
            if type(token) is not int or token < 0:
                raise InvalidRequestError("logit_bias", f"token ids must be integers >= 0, got {token!r}")
            if not (low <= bias <= high):  # NaN fails too
                raise InvalidRequestError("logit_bias", f"bias of token {token} must be in [{low:g}, {high:g}], "
                                                        f"got {bias}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_logit_bias(self) -> bool:
        return bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


DRAFT_KINDS = ("model", "ngram", "suffix", "none")


@dataclass(frozen=True)
class SpecParams:
    """How a request speculates. `k=None` means auto."""

    contract: Contract = "greedy"
    k: int | None = None
    draft: str = "model"  # "model" (the configured draft model) | "ngram" | "suffix" (token trees) | "none"

    def __post_init__(self) -> None:
        if self.contract not in CONTRACTS:
            raise InvalidRequestError("contract", f"unknown contract {self.contract!r}; known: {', '.join(CONTRACTS)}")
        if self.k is not None and not (0 <= self.k <= MAX_K):
            raise InvalidRequestError("k", f"must be in [0, {MAX_K}] or auto, got {self.k}")
        if self.draft not in DRAFT_KINDS:
            raise InvalidRequestError("draft", f"unknown draft {self.draft!r}; known: {', '.join(DRAFT_KINDS)}")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    spec: SpecParams = field(default_factory=SpecParams)
    constraint: Constraint | None = None  # the output must match it (None: free text)
    trace_context: tuple[tuple[str, str], ...] = ()  # W3C traceparent/tracestate of the caller's span (tracing.py)
    # whose request it is, for fair admission (cluster/engine/fair_share.py): an API key's or a connection's id, never a
    # key; "" = the one shared tenant (in-process use)
    tenant: str = ""

    def __post_init__(self) -> None:
        if not self.request_id:
            raise InvalidRequestError("request_id", "must be non-empty")
        check_identifier("request_id", self.request_id)
        check_identifier("tenant", self.tenant)
        if len(self.prompt_token_ids) == 0:
            raise InvalidRequestError("prompt", "must be non-empty")


@dataclass(frozen=True)
class RowLogprobs:
    """Log-probabilities of consecutive positions, as the verifier computed them (float32, the bits plain decoding
    gives): each position's chosen token's (and its rank), and its top alternatives (ids and log-probabilities,
    likeliest first). `rows` positions; `top_ids` / `top_logprobs` are [rows, n], n the request's count."""

    token_logprobs: np.ndarray  # [rows] float32
    top_ids: np.ndarray  # [rows, n] int32
    top_logprobs: np.ndarray  # [rows, n] float32
    ranks: np.ndarray  # [rows] int32: the chosen token's rank (1 + the tokens strictly likelier; vLLM's `rank`)

    def __len__(self) -> int:
        return int(self.token_logprobs.shape[0])

    def head(self, rows: int) -> RowLogprobs:
        """The first `rows` positions."""
        return self.rows(0, rows)

    def rows(self, start: int, stop: int) -> RowLogprobs:
        return RowLogprobs(self.token_logprobs[start:stop], self.top_ids[start:stop], self.top_logprobs[start:stop],
                           self.ranks[start:stop])

    def entries(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """Per position: (its token's log-probability, [(id, log-probability) of the top alternatives])."""
        ids, values = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [(float(lp), list(zip(row_ids, row_values, strict=True)))
                for lp, row_ids, row_values in zip(self.token_logprobs.tolist(), ids, values, strict=True)]

    @staticmethod
    def concat(parts: Sequence[RowLogprobs]) -> RowLogprobs:
        return RowLogprobs(np.concatenate([p.token_logprobs for p in parts]),
                           np.concatenate([p.top_ids for p in parts]),
                           np.concatenate([p.top_logprobs for p in parts]),
                           np.concatenate([p.ranks for p in parts]))


@dataclass
class TokenChunk:
    """What one round emitted for one request, in order. `finish_reason` is set on the last chunk."""

    request_id: str
    token_ids: list[int]
    text_delta: str = ""
    proposed: int = 0  # draft tokens proposed this round
    accepted: int = 0  # draft tokens accepted this round
    forced: int = 0  # of the proposed drafts, those the request's constraint forced (no draft model ran for them)
    finish_reason: FinishReason | None = None
    stats: dict | None = None  # per-request statistics, on the final chunk only
    offset: int = 0  # where token_ids start in the completion's output (tokens sent before): a client sees a
    # skipped or repeated token from the stream alone
    logprobs: RowLogprobs | None = None  # token_ids' log-probabilities (sampling.logprobs set), one row each
    # the prompt's (sampling.prompt_logprobs set), on the completion's first chunk: rows for prompt tokens 1.. (the
    # first prompt token has none)
    prompt_logprobs: RowLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
