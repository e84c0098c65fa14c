"""Constraints: the request's output must match a JSON schema, a regex, one of several strings or a grammar.

A constraint is a per-position logits processor along a row's history, beside the penalties (docs/contracts.md,
"Constraints and logit bias"): at each position the target's distribution is the request's transform applied to
the logits with every token the constraint forbids removed. It is compiled once per request at submit (llguidance: its
tokenizer built once per engine, each grammar compiled once and cached, a request's matcher a copy of the cached
one), carried on the RequestState, and used by three phases, all on the engine thread:

    plan     `forced(limit)`: tokens the constraint forces from here (llguidance's fast-forward tokens) are
             drafted at no draft cost (planner.py)
    verify   `constrain(plan)`: each row's allowed tokens along its own prefix, as a bitmask the verifier applies
             to its logits (a chain's row j after drafts d_0..d_{j-1}; a tree's node along its path); drafts the
             constraint forbids are cut here (below); the matcher is rolled back after each path, never replayed
    accept   `advance(tokens)`: the kept tokens move the matcher; where it has completed, the request stops

Cutting forbidden drafts keeps every contract exact (docs/exactness.md, "Constraints"):
  - greedy, point-mass drafts (n-gram, lookup, suffix, forced): a draft the constraint forbids has p = 0, so the
    contract would reject it and draw the next token from p (the residual (p - delta_x)+ is p): the chain is cut
    before it, and that position draws from p as a bonus, the same distribution (and the same uniform stream);
  - drafts with their q (a sampled draft model's chain): the first forbidden draft stays (its rejection draws from
    the residual (p - q)+, which must see q), the drafts after it are cut: w_j = 0 from there on, so no longer
    prefix could pass the token or the block rule; the rows after it are never read for a token and get no mask;
  - trees (deterministic siblings): a forbidden node has r(c) = 0 and is never accepted; removing it and its
    subtree leaves r unchanged for its siblings, so the tree is pruned before the verify.

A bitmask is int32 words, bit i of word w allowing token 32 w + i (llguidance's layout); tokens of the model's
vocabulary beyond the tokenizer's are never allowed.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specserve_types.api import MAX_CHOICES, Constraint, InvalidRequestError

CACHE_SIZE = 64  # compiled grammars kept per engine


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


ALL_ALLOWED = -1  # an int32 word with every bit set


def grammar_source(constraint: Constraint, tokenizer: Any = None) -> str:
    """The constraint as an llguidance grammar (JSON of its grammar format); raises InvalidRequestError. With the
    HF `tokenizer`, choices it cannot spell are refused."""
    import llguidance

    kind, value = constraint.kind, constraint.value
    if kind == "json":
        try:
            schema = json.loads(value)
        except ValueError as exc:
            raise InvalidRequestError(constraint.field, f"is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError(constraint.field, "a JSON schema is an object (or true)")
        if schema is True or schema == {}:
            schema = {}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as exc:
            raise InvalidRequestError(constraint.field, f"is not a usable JSON schema: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        try:
            choices = json.loads(value)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError(constraint.field, "choices are a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise InvalidRequestError(constraint.field, f"at most {MAX_CHOICES} choices, got {len(choices)}")
        alternatives = " | ".join(json.dumps(c) for c in dict.fromkeys(choices))  # Lark string literals
        if tokenizer is not None:
            for index, choice in enumerate(choices):  # what the vocabulary cannot spell could never be emitted
                if tokenizer.decode(tokenizer.encode(choice, add_special_tokens=False)) != choice:
                    raise InvalidRequestError(constraint.field, f"choice {index} ({choice!r}) cannot be spelled by "
                                                                f"the model's tokenizer")
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    assert kind == "grammar", kind
    return llguidance.LLMatcher.grammar_from_lark(value)


_LL_TOKENIZERS: dict[tuple[Any, ...], Any] = {}
_LL_LOCK = threading.Lock()


def shared_ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's tokenizer for an HF tokenizer, built once per process (~1 s) and shared by every engine over the
    same tokenizer files (a benchmark's fresh engines, a test's), keyed by the files' path (or the object where it
    has none), vocabulary and end-of-sequence ids."""
    import llguidance.hf

    key = (getattr(tokenizer, "name_or_path", "") or id(tokenizer), len(tokenizer), vocab_size, tuple(eos_token_ids))
    with _LL_LOCK:
        built = _LL_TOKENIZERS.get(key)
        if built is None:
            built = _LL_TOKENIZERS[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                                       eos_token=list(eos_token_ids))
        return built


class ConstraintCompiler:
    """One per engine: the llguidance tokenizer (built once from the HF tokenizer, ~1 s) and the compiled grammars,
    a pristine matcher per constraint (LRU, CACHE_SIZE), copied for each request. Thread-safe: submit runs on
    callers' threads."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], prebuild: bool = False) -> None:
        """`prebuild`: build llguidance's tokenizer now on a thread of its own (~1 s), so that the first constrained
        request does not wait for it (it waits only if it comes sooner)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()
        if prebuild:
            threading.Thread(target=self.ll_tokenizer, name="llguidance-tokenizer", daemon=True).start()

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = shared_ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._ll_tokenizer

    def compile(self, constraint: Constraint) -> RequestConstraint:
        """A fresh matcher at the start of the output; raises InvalidRequestError naming the constraint's field."""
        import llguidance

        with self._lock:
            pristine = self._cache.get(constraint)
            if pristine is not None:
                self._cache.move_to_end(constraint)
        if pristine is None:
            source = grammar_source(constraint, self.tokenizer)
            tokenizer = self.ll_tokenizer()
            try:
                pristine = llguidance.LLMatcher(tokenizer, source, log_level=0)
            except (ValueError, RuntimeError) as exc:
                raise InvalidRequestError(constraint.field, f"does not compile: {exc}") from None
            if pristine.is_error():
                raise InvalidRequestError(constraint.field, f"does not compile: {pristine.get_error()}")
            with self._lock:
                self._cache[constraint] = pristine
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return RequestConstraint(pristine.deep_copy(), mask_words(self.vocab_size), self.eos_token_ids)


@dataclass(frozen=True)
class RowMasks:
    """What the constraint makes of one round's drafts: how many of them to keep (a chain's prefix; a tree's
    surviving nodes, in their order) and each verified row's allowed tokens [rows, words] int32."""

    keep: tuple[int, ...]  # indices into the drafts, in order (a chain: 0..n-1)
    allowed: np.ndarray


def timed(method: Any) -> Any:
    """The method's seconds added to the constraint's own `seconds` (its cost, which bench structured reports)."""

    @functools.wraps(method)
    def wrapper(self: RequestConstraint, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    return wrapper


class RequestConstraint:
    """One request's matcher, at its committed output (owner: the engine thread). Each method leaves it there but
    `advance`, which moves it by kept tokens. `seconds`: the time its public methods took (the constraint's cost)."""

    def __init__(self, matcher: Any, words: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.matcher = matcher
        self.words = words
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.seconds = 0.0
        self.eos_only = np.zeros(words, dtype=np.int32)  # what may follow an end of sequence: only another
        for token in self.eos:
            if token < 32 * words:
                self.eos_only[token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))

    def fork(self) -> RequestConstraint:
        return RequestConstraint(self.matcher.deep_copy(), self.words, sorted(self.eos))

    @property
    def done(self) -> bool:
        """Completed: nothing but end of sequence may follow (the request then stops)."""
        return bool(self.matcher.is_stopped())

    def allowed_mask(self) -> np.ndarray:
        """int32 [words]: the tokens allowed next."""
        mask = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)
        if mask.size < self.words:  # the tokenizer's vocabulary is shorter than the model's: the rest is forbidden
            mask = np.concatenate([mask, np.zeros(self.words - mask.size, dtype=np.int32)])
        return mask[:self.words]

    @timed
    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the constraint forces from here (its fast-forward tokens; a token the model may
        still spell differently, so they are drafts, verified as any)."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return [int(t) for t in self.matcher.compute_ff_tokens()[:limit]]

    @timed
    def advance(self, tokens: Sequence[int]) -> bool:
        """The kept tokens of a round (each allowed by the verifier's masks); an end of sequence ends the output and
        moves nothing. False (the matcher left before the token) where one leads where nothing can follow: the mask
        allows it, but the rest of the constraint needs a string the vocabulary cannot spell (llguidance's
        NoExtensionBias); the request then cannot complete its constraint."""
        for token in tokens:
            if int(token) not in self.eos and self.matcher.try_consume_tokens([int(token)]) != 1:
                return False
        return True

    def _walk(self, tokens: Sequence[int], masks: list[np.ndarray] | None = None) -> tuple[int, int]:
        """Move along `tokens` while the constraint allows them: (how many it allows, how many the matcher consumed:
        an end of sequence is not consumed, only end of sequence may follow it). With `masks`, each row's allowed
        tokens before each token and after the last allowed one are appended there."""
        allowed, consumed, ended = 0, 0, False
        for token in tokens:
            mask = self.eos_only if ended else self.allowed_mask()
            if masks is not None:
                masks.append(mask)
            token = int(token)
            if not (int(mask[token // 32]) >> (token % 32)) & 1:
                break
            if token in self.eos:
                ended = True
            elif self.matcher.try_consume_tokens([token]) == 1:
                consumed += 1
            else:  # allowed by the mask, yet nothing could follow it (a string the vocabulary cannot spell)
                break
            allowed += 1
        else:
            if masks is not None:
                masks.append(self.eos_only if ended else self.allowed_mask())
        return allowed, consumed

    @timed
    def chain_masks(self, drafts: Sequence[int], with_q: bool) -> RowMasks:
        """Rows 0..n for the first n drafts kept: n = the drafts the constraint allows, plus the first forbidden one
        where the drafts carry q (its rejection draws from the residual); rows after a forbidden draft allow all."""
        masks: list[np.ndarray] = []
        valid, consumed = self._walk(drafts, masks)
        if consumed:
            self.matcher.rollback(consumed)
        n = min(len(drafts), valid + 1) if with_q else valid
        allowed = np.full((n + 1, self.words), ALL_ALLOWED, dtype=np.int32)
        allowed[:valid + 1] = np.stack(masks[:valid + 1])
        return RowMasks(tuple(range(n)), allowed)

    @timed
    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int]) -> RowMasks:
        """A tree's root row and each surviving node's row (the state after its path); nodes the constraint forbids
        are dropped with their subtrees (parents come before children)."""
        rows = [self.allowed_mask()]
        keep: list[int] = []
        alive: set[int] = set()
        for node, parent in enumerate(parents):
            if parent != -1 and parent not in alive:
                continue
            path = [node]
            while parents[path[-1]] != -1:
                path.append(parents[path[-1]])
            path_tokens = [int(tokens[i]) for i in reversed(path)]
            ok, consumed = self._walk(path_tokens)
            if ok == len(path_tokens):
                alive.add(node)
                keep.append(node)
                rows.append(self.eos_only if path_tokens[-1] in self.eos or consumed < ok else self.allowed_mask())
            if consumed:
                self.matcher.rollback(consumed)
        return RowMasks(tuple(keep), np.stack(rows))


def logit_bias_errors(logit_bias: Sequence[tuple[int, float]], vocab_size: int) -> str | None:
    """Why a request's logit_bias cannot run on a vocabulary of `vocab_size` (None: it can)."""
    outside = [token for token, _ in logit_bias if token >= vocab_size]
    if outside:
        return f"token id {outside[0]} is outside the vocabulary [0, {vocab_size})"
    return None
