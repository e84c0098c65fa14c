"""A constrained request's chain drafted under its constraint: the draft model's q masked along the chain's own
drafts, as the target's p is along the verified rows (verifier_service/constraint.py), so the drafter proposes no
token the constraint forbids (without it the engine cuts such drafts before the verify, round_plan.constrained).

The drafter keeps one matcher per constrained request (an LRU of MAX_REQUESTS; a cache, as its KV is): each propose
carries the request's committed output, which its matcher catches up with (only the tokens since the last propose;
a new drafter process, an evicted entry or another constraint under the same id compiles again and replays the
output once). During the propose the matcher moves along the chain's drafts and is rewound after it. q stays a
function of the context alone, so every contract holds (docs/exactness.md, "Constraints").

Owner: the drafter's compute thread (one propose at a time).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_runtime.config import ModelConfig, eos_token_ids
from specserve_types.api import Constraint
from specserve_types.round_messages import ProposeItem
from verifier_service.constraint import ConstraintCompiler, RequestConstraint

log = logging.getLogger("specserve.drafter")

MAX_REQUESTS = 1024


@dataclass
class DraftMatcher:
    """One request's matcher during a propose: at its committed output, then along the chain's drafts."""

    constraint: RequestConstraint
    stepped: int = 0
    ended: bool = False  # the chain drafted an end of sequence: only another may follow

    def allowed_mask(self) -> np.ndarray:
        return self.constraint.eos_only if self.ended else self.constraint.allowed_mask()

    def step(self, token: int) -> bool:
        """The chain drafted `token`: False where the constraint forbids it (the matcher is then left as it was)."""
        if int(token) in self.constraint.eos:
            self.ended = True
            return True
        if self.ended or not self.constraint.matcher.try_consume_tokens([int(token)]):
            return False
        self.stepped += 1
        return True

    def rewind(self) -> None:
        if self.stepped:
            self.constraint.matcher.rollback(self.stepped)
        self.stepped, self.ended = 0, False


class DraftConstraints:
    """The drafter's matchers of constrained requests, compiled with the draft model's tokenizer (loaded on the first
    constrained request: `make_compiler`)."""

    def __init__(self, make_compiler: Callable[[], ConstraintCompiler], prebuild: bool = False) -> None:
        """`prebuild`: load the tokenizer and build llguidance's on a thread of its own (~2 s), so that the first
        constrained propose does not wait for them (only if it comes sooner)."""
        self._make_compiler = make_compiler
        self._compiler: ConstraintCompiler | None = None
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[Constraint, RequestConstraint, int]] = OrderedDict()
        if prebuild:
            threading.Thread(target=lambda: self.compiler().ll_tokenizer(), name="draft-constraints",
                             daemon=True).start()

    def compiler(self) -> ConstraintCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def matchers(self, items: Sequence[ProposeItem]) -> dict[str, DraftMatcher]:
        """A matcher per item at its committed output (`output_ids`); an item whose constraint does not compile here
        or whose output it does not accept drafts freely (logged: the engine's matcher is the judge)."""
        out: dict[str, DraftMatcher] = {}
        for item in items:
            assert item.constraint is not None
            try:
                out[item.request_id] = DraftMatcher(self._caught_up(item.request_id, item.constraint, item.output_ids))
            except Exception as exc:  # never fails a propose: this chain drafts freely
                self._entries.pop(item.request_id, None)
                log.warning("%s: drafting without its constraint: %s", item.request_id, exc)
        return out

    def _caught_up(self, request_id: str, constraint: Constraint, output: Sequence[int]) -> RequestConstraint:
        entry = self._entries.get(request_id)
        if entry is None or entry[0] != constraint or entry[2] > len(output):
            entry = (constraint, self.compiler().compile(constraint), 0)
        _, matcher, consumed = entry
        if not matcher.advance(output[consumed:]):
            raise ValueError("its output leaves the constraint where nothing can follow")
        self._entries[request_id] = (constraint, matcher, len(output))
        self._entries.move_to_end(request_id)
        while len(self._entries) > MAX_REQUESTS:
            self._entries.popitem(last=False)
        return matcher


def tokenizer_compiler(checkpoint_dir: str, vocab_size: int) -> Callable[[], ConstraintCompiler]:
    """A compiler over the tokenizer saved with the draft model (its end-of-sequence ids as the engine reads a
    checkpoint's: model_runtime.config.eos_token_ids), built when first called."""

    def make() -> ConstraintCompiler:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
        config = ModelConfig.from_dir(Path(checkpoint_dir))
        return ConstraintCompiler(tokenizer, vocab_size, eos_token_ids(Path(checkpoint_dir), config, tokenizer))

    return make
