"""Per-request state owned by the engine (one owner: the engine loop's thread).

Tokens are the truth: `token_ids` holds the prompt and every committed output token; worker KV
caches are derived from it (`target_cached` / `draft_cached` count how many of these tokens each
cache holds) and can always be rebuilt by re-prefilling.

    token_ids:  [ p0 p1 ... p_{P-1} | o0 o1 ... o_{m-1} ]
                  prompt (P tokens)     output (m tokens)
    target_cached = tokens with target KV;  pending_target = token_ids[target_cached:]
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.prompt_group import PromptGroup
from cluster.engine.stop_strings import ROOT, stop_matcher
from drafter_service.ngram import TokenHistory
from specserve_types.api import (
    MAX_TOKENS_LIMIT,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)
from verifier_service.constraint import ConstraintCompiler, RequestConstraint, logit_bias_errors

log = logging.getLogger("specserve.engine")


@dataclass
class PolicyEvent:
    at: float
    k: int
    reason: str


DECODE_CONTEXT = 6  # tokens decoded before the new ones, so that a decoder's word boundaries read as in the whole


@dataclass
class TextTracker:
    """Incremental detokenization with stop strings (also across token boundaries).

    Emits text only when it can no longer become part of a stop string and is not a half UTF-8
    character; the stop string itself is never emitted.

    `text` is always the decode of the whole output, built incrementally (vLLM's offsets): `stable` is the decode of
    the first `read` output tokens, ending on a whole character, and each update decodes only the tokens after it
    with a few before them as context, keeping the part past the context's own decode. Where that part cannot be
    read off (a decoder that rewrites text across the boundary), it decodes the whole output as before. So a token
    costs a decode of a few tokens, not of the output so far (docs/forward.md, "A long output's Python").
    The stop strings are one automaton (cluster/engine/stop_strings.py) fed each new character once, so a token costs
    the same whatever they are; the text held back is the longest end of the text that could still start one.
    """

    tokenizer: Any
    prompt_len: int
    stop: tuple[str, ...]
    emitted_chars: int = 0
    text: str = ""
    stable: str = ""
    read: int = 0  # output tokens whose decode is `stable`
    fed: str = ""  # the text the stop strings' automaton has read (up to a trailing U+FFFD)
    state: int = ROOT  # the automaton's state after `fed`

    def update(self, token_ids: list[int]) -> tuple[str, bool]:
        """Given the full sequence, return (new text delta, stop string hit)."""
        if self.tokenizer is None:
            return "", False
        self.text = self._decoded(token_ids)
        hit, held = self._scan() if self.stop else (False, 0)
        if hit:  # the first stop string (in their order) found past what was emitted: the text ends before it
            for s in self.stop:
                idx = self.text.find(s, max(0, self.emitted_chars - len(s) + 1))
                if idx != -1:
                    self.text = self.text[:idx]
                    delta = self.text[self.emitted_chars:]
                    self.emitted_chars = len(self.text)
                    return delta, True
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe -= 1
        safe = max(safe - held, self.emitted_chars)  # hold back an end that may start a stop string
        delta = self.text[self.emitted_chars:safe]
        self.emitted_chars = safe
        return delta, False

    def _scan(self) -> tuple[bool, int]:
        """Feed the stop strings' automaton the text's new characters: (a stop string ends past what was emitted,
        the characters at the text's end, before a trailing U+FFFD, that could still start one)."""
        matcher, text = stop_matcher(self.stop), self.text
        end = len(text) - 1 if text.endswith("\ufffd") else len(text)
        if not text.startswith(self.fed):  # a decoder that rewrote text already read: read it all again
            self.fed, self.state = "", ROOT
        state, hit = self.state, False
        for at in range(len(self.fed), end):
            state = matcher.step(state, text[at])
            hit = hit or (matcher.ends[state] and at >= self.emitted_chars)
        self.fed, self.state = text[:end], state
        if end < len(text):  # the U+FFFD itself (read again once its character is whole)
            hit = hit or matcher.ends[matcher.step(state, text[end])]
        return hit, matcher.depth[state]

    def _decoded(self, token_ids: list[int]) -> str:
        """The decode of the whole output (token_ids past the prompt), from `stable` and the tokens after it."""
        decode, first = self.tokenizer.decode, self.prompt_len + self.read
        start = max(self.prompt_len, first - DECODE_CONTEXT)
        context = decode(token_ids[start:first], skip_special_tokens=True)
        tail = decode(token_ids[start:], skip_special_tokens=True)
        if tail.startswith(context) and not context.endswith("\ufffd"):
            text = self.stable + tail[len(context):]
        else:
            text = decode(token_ids[self.prompt_len:], skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # a whole character: the next decode starts after it
            self.stable, self.read = text, len(token_ids) - self.prompt_len
        return text

    def flush(self) -> str:
        delta = self.text[self.emitted_chars:].rstrip("\ufffd") if self.tokenizer is not None else ""
        self.emitted_chars = len(self.text)
        return delta


@dataclass
class RequestState:
    request: GenerationRequest
    seed: int
    text: TextTracker
    eos_token_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    target_cached: int = 0
    draft_cached: int = 0
    finish_reason: FinishReason | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    admitted_at: float | None = None  # first admission (the end of its wait in the queue)
    finished_at: float | None = None
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)  # its drafter's drafts (auto reads it)
    lookup_acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)  # a model request's n-gram lookups
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    reconcile_seconds: float = 0.0
    rounds: int = 0
    k: int = 0
    policy_events: list[PolicyEvent] = field(default_factory=list)
    admitted: bool = False
    draft_admitted: bool = False
    group: int = 0  # overlap group (0 or 1)
    rounds_at_zero: int = 0  # consecutive rounds auto chose plain decoding (it re-probes after probe_every)
    prompt_group: PromptGroup | None = None  # n completions of one prompt, until forked (prompt_group.py)
    history: TokenHistory = field(default_factory=TokenHistory)  # token_ids as an array, for n-gram lookups
    # the request's constraint at its committed output (constraint.py): moved by append_tokens only
    constraint: RequestConstraint | None = None
    forced: int = 0  # drafts its constraint forced (planner.py)
    forced_accepted: int = 0
    prompt_scored: bool = False  # its prompt's log-probabilities were sent (sampling.prompt_logprobs): accept.py

    @property
    def scores_prompt(self) -> bool:
        """Its next round scores its prompt: asked for, not yet sent, and the round prefills from the start."""
        return self.request.sampling.prompt_logprobs is not None and not self.prompt_scored and self.target_cached == 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    def token_array(self) -> np.ndarray:
        """token_ids as an array (a view until the next call; only ids added since the last call are copied)."""
        return self.history.view(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def append_tokens(self, new_tokens: list[int]) -> tuple[list[int], str]:
        """Append tokens one by one, stopping exactly where plain decoding would; returns (kept, text delta)."""
        kept: list[int] = []
        params = self.request.sampling
        delta = ""
        if params.max_tokens == 0:  # the prompt scored, nothing generated
            self.finish_reason, self.finished_at = "length", time.monotonic()
            return kept, delta
        for token in new_tokens:
            self.token_ids.append(token)
            kept.append(token)
            piece, hit_stop = self.text.update(self.token_ids)
            delta += piece
            if hit_stop:
                self.finish_reason = "stop"
            elif token in self.eos_token_ids and not params.ignore_eos:
                self.finish_reason = "eos"
            elif self.constraint is not None and (ended := self._constraint_end(token)) is not None:
                self.finish_reason = ended  # completed: only end of sequence may follow; or a dead end
            elif self.num_output >= params.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                delta += "" if hit_stop else self.text.flush()  # a stop string's text is cut, not flushed
                self.finished_at = time.monotonic()
                break
        if kept and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        return kept, delta

    def _constraint_end(self, token: int) -> FinishReason | None:
        """None while the constraint goes on; "stop" where it completed; "error" where it cannot go on (a string the
        vocabulary cannot spell: constraint.advance), logged: the request ends, the engine does not."""
        assert self.constraint is not None
        if not self.constraint.advance([token]):
            log.warning("%s: its constraint cannot continue after token %d (it needs a string the vocabulary cannot "
                        "spell): ended", self.request_id, token)
            return "error"
        return "stop" if self.constraint.done else None

    def forget_kv(self) -> None:
        """Its KV was given back (preempted, or the verifier lost it): it re-prefills from its tokens."""
        self.target_cached = self.draft_cached = 0
        self.admitted = self.draft_admitted = False

    def forget_draft_kv(self) -> None:
        """Its draft KV is gone (the drafter restarted, or the ledger refused its draft commit): it re-enters the
        draft namespace and re-prefills its draft cache."""
        self.draft_cached, self.draft_admitted = 0, False

    def record_k(self, k: int, reason: str, rounds_at_zero: int | None = None) -> None:
        """A round's k and why (a repeated k is kept once), and its plain-decoding rounds so far (None: as they
        were). The engine calls it with what a plan holds (RoundPlan.reason, rounds_at_zero)."""
        if k != self.k or not self.policy_events:
            self.policy_events.append(PolicyEvent(time.monotonic() - self.arrival, k, reason))
        self.k = k
        if rounds_at_zero is not None:
            self.rounds_at_zero = rounds_at_zero

    def all_acceptance(self) -> AcceptanceStats:
        """Every draft it proposed: its drafter's and its n-gram lookups' (planner.py)."""
        return self.acceptance.merge(self.lookup_acceptance)

    def stats(self) -> dict[str, Any]:
        every = self.all_acceptance()
        acc = every.to_dict()
        lookup = {"lookup_acceptance": self.lookup_acceptance.to_dict()} if self.lookup_acceptance.rounds else {}
        return {
            "rounds": self.rounds,
            "prompt_tokens": self.prompt_len,
            "output_tokens": self.num_output,
            "contract": self.request.spec.contract,
            "acceptance": acc,
            "draft_seconds": round(self.draft_seconds, 6),
            "verify_seconds": round(self.verify_seconds, 6),
            "reconcile_seconds": round(self.reconcile_seconds, 6),
            "ttft_seconds": None if self.first_token_at is None else round(self.first_token_at - self.arrival, 6),
            "queued_seconds": None if self.admitted_at is None else round(self.admitted_at - self.arrival, 6),
            "e2e_seconds": round((self.finished_at or time.monotonic()) - self.arrival, 6),
            "speculative_decoding": every.speculative_decoding(),
            "policy_events": [{"at": round(e.at, 6), "k": e.k, "reason": e.reason} for e in self.policy_events],
            **lookup,
            **({"forced": {"proposed": self.forced, "accepted": self.forced_accepted},
                "constraint_seconds": round(self.constraint.seconds, 6)} if self.constraint is not None else {}),
        }


def resolve_max_tokens(sampling: SamplingParams, prompt_len: int, max_context: int,
                       most: int = MAX_TOKENS_LIMIT) -> SamplingParams:
    """`sampling` with max_tokens set: as asked, or where the request left it unset (None) the tokens the context
    leaves beside the prompt, at most `most` (MAX_TOKENS_LIMIT; the scheduler's a request's share of
    max_request_tokens too): the answer then ends where the model ends it (EOS, a stop string), as plain decoding
    would, or where the context does ("length"). Done once, where the prompt's length is first known: the scheduler
    (its limits and client shares count the value) or, in process, the engine's submit. A prompt that leaves no
    room raises InvalidRequestError naming the prompt."""
    if sampling.max_tokens is not None:
        return sampling
    room = max_context - prompt_len
    if room < 1:
        raise InvalidRequestError("prompt", f"prompt ({prompt_len} tokens) leaves no room to generate in the "
                                            f"context of {max_context} tokens")
    return replace(sampling, max_tokens=min(room, most))


def new_request_state(request: GenerationRequest, tokenizer: Any, eos_token_ids: frozenset[int], vocab_size: int,
                      max_context: int, has_drafter: bool,
                      constraints: ConstraintCompiler | None = None) -> RequestState:
    """A submitted request's state; raises InvalidRequestError (naming the field) for what this engine can't run.
    An unset max_tokens is resolved here (`resolve_max_tokens`): the state's request carries the value."""
    prompt_len = len(request.prompt_token_ids)
    if request.sampling.max_tokens is None:
        request = replace(request, sampling=resolve_max_tokens(request.sampling, prompt_len, max_context))
    assert request.sampling.max_tokens is not None
    if prompt_len + request.sampling.max_tokens > max_context:
        raise InvalidRequestError(
            "prompt", f"prompt ({prompt_len} tokens) + max_tokens ({request.sampling.max_tokens}) exceeds the "
                      f"context of {max_context} tokens")
    if any(not (0 <= t < vocab_size) for t in request.prompt_token_ids):
        raise InvalidRequestError("prompt", f"token ids must be in [0, {vocab_size})")
    if request.spec.draft == "model" and not has_drafter and request.spec.k != 0:
        raise InvalidRequestError("draft", "this engine has no draft model; use draft 'ngram' or 'none'")
    bias_error = logit_bias_errors(request.sampling.logit_bias, vocab_size)
    if bias_error is not None:
        raise InvalidRequestError("logit_bias", bias_error)
    constraint = None
    if request.constraint is not None:
        if constraints is None:
            raise InvalidRequestError(request.constraint.field, "this engine has no tokenizer to compile constraints")
        constraint = constraints.compile(request.constraint)  # raises InvalidRequestError naming the field
    seed = request.sampling.seed if request.sampling.seed is not None else random.getrandbits(63)
    return RequestState(request=request, seed=seed, eos_token_ids=eos_token_ids,
                        text=TextTracker(tokenizer, prompt_len, request.sampling.stop),
                        token_ids=list(request.prompt_token_ids), prompt_len=prompt_len, constraint=constraint)
