"""What one `specserve check exact` run samples and how it judges (`CheckSettings`), and the samples of one
prompt (`PromptSamples`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve_types.api import Constraint, SamplingParams, SpecParams, SpecServeError

# Short prompts whose suffix repeats earlier text, so n-gram drafting proposes from the first output token on
# (a prompt without a repeat gets no n-gram drafts, and the check would only test plain decoding), and whose
# drafts the target often but not always accepts (on SmolLM2 at temperature 1 the first draft has p 0.3-0.7):
# rejections exercise the residual, and the modal prefixes hold enough samples to test positions 2 and 3.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "red, green, blue, red, green, blue, red,",
    "Monday, Tuesday, Wednesday. Monday, Tuesday,",
    "1, 2, 3, 1, 2,",
    "Alice went home. Bob went home. Alice went",
)


@dataclass(frozen=True)
class CheckSettings:
    """What one check run samples and how it judges."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    k: int | None = 3  # draft tokens per round (None: auto)
    draft: str = "ngram"  # "ngram", "suffix" (token trees) or "model" (the request's SpecParams.draft)
    n: int = 2500  # samples per prompt
    positions: tuple[int, ...] = (1, 2, 3)  # output positions tested, 1-based
    alpha: float = 1e-3  # per test (prompt x position)
    tv: float = 0.1  # the total variation the test must be able to detect ...
    min_power: float = 0.8  # ... with at least this power
    seed: int = 0
    # constrained decoding: every request's constraint (the reference masks what it forbids along the prefix) and
    # OpenAI's logit_bias, (token id, bias) pairs added to the raw logits (the reference adds them too)
    constraint: Constraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.n < 1:
            raise SpecServeError("n: must be >= 1")
        if not self.positions or min(self.positions) < 1:
            raise SpecServeError("positions: need one or more positions >= 1")
        if not 0 < self.alpha < 1:
            raise SpecServeError("alpha: must be in (0, 1)")
        if not 0 < self.tv <= 1:
            raise SpecServeError("tv: must be in (0, 1]")
        if not 0 < self.min_power < 1:
            raise SpecServeError("min_power: must be in (0, 1)")
        if self.draft not in ("ngram", "suffix", "model"):
            raise SpecServeError("draft: the check needs speculation on: 'ngram', 'suffix' or a draft model")

    @property
    def max_tokens(self) -> int:
        return max(self.positions)

    def sampling(self, seed: int | None = None) -> SamplingParams:
        """The requests' sampling (EOS ignored: every sample has max_tokens tokens), also the reference's
        transform."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed,
                              max_tokens=self.max_tokens, ignore_eos=True, logit_bias=self.logit_bias)

    @property
    def contract(self) -> str:
        return "greedy" if self.temperature == 0 else "exact"

    def spec(self) -> SpecParams:
        return SpecParams(contract=self.contract, k=self.k, draft=self.draft)

    def first_seed(self, prompt_index: int) -> int:
        return self.seed + prompt_index * self.n


@dataclass
class PromptSamples:
    """The samples of one prompt: `tokens[i]` is completion i (seed first_seed + i)."""

    prompt: str
    prompt_ids: list[int]
    first_seed: int
    tokens: list[tuple[int, ...]] = field(default_factory=list)
    proposed: int = 0  # draft tokens proposed over all its rounds
    accepted: int = 0
    forced: int = 0  # of the proposed, those the constraint forced
