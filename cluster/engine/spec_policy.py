"""Speculation policy: how many draft tokens k each request proposes this round.

Fixed k, or auto. Auto maximises expected tokens per second with the measured quantities of
docs/contracts.md:

    E[Y](k) = 1 + sum_{i=1..k} s_i                  (s_i measured per request, per position)
    t_cycle(k) = k * t_draft_token + t_verify(n + k) (online cost model, n = catch-up tokens; t_verify fitted
                                                     non-decreasing in rows: CostModel.monotone_verify)
    pick k* = argmax_k E[Y](k) / t_cycle(k)   over k = 0..k_max   (k = 0 is plain decoding)

s_i blends what the request measured at position i with an extrapolation a * c_2 * ... * c_i, where a is the
request's per-draft acceptance rate accepted / (accepted + rejections), itself shrunk towards the
engine-wide rate (and that towards PRIOR_SURVIVAL), and c_j the engine-wide ratio s_j / s_{j-1} (shrunk towards
a; a alone, i.e. geometric a^i, until the engine has reached position j). So a request that ran at k=1 and kept
every draft expects deeper drafts to survive too and tries them, instead of holding positions it never measured
at a fixed prior forever; and one that lost many first drafts still expects what the engine measured of deeper
ones once a first draft survived (in `bench spec`, conditional survival rose with depth: 0.76, 0.78, 0.83),
which geometric extrapolation at its low rate would not.
While plain decoding wins, the request re-probes speculation every `probe_every` rounds. Under
memory pressure (ledger free fraction below `pressure_free_fraction`) k is capped at 1.
Every change of k is recorded on the request with its reason.

Seeded requests (`choose_k_seeded`) decide from their own history only: the same survival estimate with the
engine-wide rate replaced by PRIOR_SURVIVAL, and fixed nominal costs instead of measured ones (no batch, no
catch-up, no memory-pressure cap). The tokens of a sampled request depend on k (other drafts, other
acceptance draws; their distribution does not), so a seed then reproduces them whatever runs beside the
request and however long its rounds took.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from cluster.engine.acceptance_stats import AcceptanceStats

PRIOR_SURVIVAL = 0.6  # assumed s_1 before any measurement; s_i = PRIOR_SURVIVAL ** i
PRIOR_ROUNDS = 4  # weight of the prior, in rounds
MAX_ROWS = 128  # verify times are kept per rows scored by the whole batch, up to this many
PREFER_SMALLER = 1.02  # a larger k must beat the best smaller one by 2%
# measured costs only: plain decoding must beat every k >= 1 by more than this factor to be chosen. Plain rounds
# measure no acceptance (the request learns nothing while at k=0), and the costs it compares are timed at other
# moments of a noisy machine (verify of 1 row during plain rounds, of k+1 during speculative ones): in `bench spec`
# a warm-up that timed 1 row at 0.14 s and 2 rows at 0.17 s kept a prose request plain for all of its 48 tokens,
# where fixed k=3 ran it at 1.5x.
PLAIN_MARGIN = 1.05
FIT_WEIGHT = 8  # the most a row count's samples weigh in the verify-time fit (an EMA at alpha 0.2 holds ~9)



@dataclass(frozen=True)
class NominalCosts:
    """Fixed costs of seeded requests, in units of one verify of one token: a function of the command (the
    target's dtype), never of timing, so a seed reproduces its tokens. Past the table, `rows / rows_per_unit`."""

    name: str
    verify: tuple[float, ...]  # index: scored rows - 1
    rows_per_unit: int
    draft_token: float  # one draft-model step; n-gram drafting costs 0
    # one level of a draft model's token tree against one chain step: on the Xeon-AMX (int8 draft) 26 against 22 ms
    # a step in `bench spec` (CostModel.draft_tree_level)
    tree_level_factor: float = 1.2

    def verify_cost(self, rows: int) -> float:
        assert rows >= 1, rows
        return self.verify[rows - 1] if rows <= len(self.verify) else rows / self.rows_per_unit


# float32 target, float16 draft (docs/forward.md, Qwen2.5-Coder-1.5B on CPU, batch 1): scoring 2/3/4 tokens
# 0.94-1.01x / 1.13-1.30x / 1.16-1.42x one token, 5-8 tokens ~2x; a float16 0.5B draft step 28 ms against a
# ~200 ms verify.
FLOAT32_COSTS = NominalCosts("float32", (1.0, 1.0, 1.2, 1.3, 2.0, 2.0, 2.0, 2.0), 4, 0.14)
# bfloat16 target and draft (the AMX kernel, or oneDNN in pieces; `bench runtime --dtype bfloat16`): scoring
# 2..16 tokens 1.0-1.18x one token; the 0.5B draft's step 0.43x the 1.5B target's (75 vs 174 ms).
BFLOAT16_COSTS = NominalCosts("bfloat16", (1.0,) * 8 + (1.1,) * 8, 14, 0.45)
# the same with an int8 draft (`--draft-dtype int8`, the default on AMX): in `bench spec` (batch 1, greedy, k=3
# and auto) its steps took 0.22 of a verify (draft 40% and 36% of the round at mean k 2.9 and 2.5)
BFLOAT16_INT8_DRAFT_COSTS = NominalCosts("bfloat16, int8 draft", BFLOAT16_COSTS.verify, 14, 0.22)


# q4 target (the GGUF's own codes, model_runtime/quant_weights.py; Qwen2.5-Coder-1.5B on an AMD EPYC, 2 threads,
# one forward of 1/2/4/8 rows: 55 / 71 / 88 / 136 ms: the integer dot products make rows cost compute) and a q4
# 0.5B draft, whose step costs about a third of the target's
Q4_COSTS = NominalCosts("q4", (1.0, 1.3, 1.45, 1.6, 1.8, 2.0, 2.2, 2.5), 3, 0.35)
# q4 target with an int8 draft (the default for one request at a time on an AMX CPU, model_runtime/precision.py):
# on the Xeon-AMX, `bench runtime --models qwen2.5-coder-1.5b --contexts 128 --dtype q4 --no-hf --repeats 3
# --max-k 16` (2026-12-04): one row 47.3 ms, 2..16 rows 1.21 .. 3.00x; the int8 0.5B step 21.3 ms (the cost model
# of a `generate` with the 0.5B draft): 0.45 of a verify
Q4_INT8_DRAFT_COSTS = NominalCosts("q4, int8 draft", (1.0, 1.21, 1.31, 1.4, 1.61, 1.71, 1.8, 1.91, 2.16, 2.23, 2.31,
                                                      2.44, 2.7, 2.78, 2.92, 3.0), 5, 0.45)


def nominal_costs(target_dtype: str, draft_dtype: str | None = None) -> NominalCosts:
    """The seeded requests' cost table for an engine whose target (and draft) run in these dtypes."""
    if target_dtype == "q4":
        return Q4_INT8_DRAFT_COSTS if draft_dtype == "int8" else Q4_COSTS
    if target_dtype != "bfloat16":
        return FLOAT32_COSTS
    return BFLOAT16_INT8_DRAFT_COSTS if draft_dtype == "int8" else BFLOAT16_COSTS


@dataclass
class CostModel:
    """Exponential moving averages of measured times (seconds). Owner: the engine loop."""

    alpha: float = 0.2
    draft_token: float | None = None  # one draft step for one batch
    draft_tree_level: float | None = None  # one level of a draft model's token tree, for one batch
    # what each token of a draft cache's catch-up beyond the usual two adds to a propose call (a prompt's prefill in
    # the draft cache, the tokens of plain or lookup rounds): priced by catch_up.py before a request pays it
    draft_catch_up_row: float | None = None
    verify_by_tokens: dict[int, float] = field(default_factory=dict)  # rows scored by the batch -> verify time
    verify_samples: dict[int, int] = field(default_factory=dict)  # rows -> samples behind verify_by_tokens[rows]
    # during the engine's warm-up (cluster/engine/warmup.py): every sample kept, the estimate their median (a few
    # samples per shape on a noisy machine; the first call of a shape may pay one-time costs)
    warm_up_samples: dict[int | str, list[float]] | None = None
    # monotone_verify's last fit and what it was fitted from (the dict, its samples so far, its size)
    _fit: tuple[tuple[int, int, int], dict[int, float]] | None = field(default=None, repr=False, compare=False)
    _version: int = field(default=0, repr=False, compare=False)

    def observe_draft(self, steps: int, seconds: float, tree: bool = False) -> None:
        """One propose call of `steps` draft steps (a tree's: levels, each feeding the nodes so far). A tree's
        levels cost more than a chain's steps (more rows, a softmax per node), so they are kept apart: a chain's k
        is chosen at a chain's step cost, and a tree's size at what its levels add (tree_policy.py)."""
        if steps > 0 and tree:
            self.draft_tree_level = self._blend("draft tree", self.draft_tree_level, seconds / steps)
        elif steps > 0:
            self.draft_token = self._blend("draft", self.draft_token, seconds / steps)

    def observe_draft_catch_up(self, rows: int, seconds: float) -> None:
        """A propose call whose catch-up held `rows` tokens beyond the usual two, and the seconds they added to it
        (the call's time less its steps at the measured step cost)."""
        if rows > 0:
            self.draft_catch_up_row = self._blend("draft catch-up", self.draft_catch_up_row, max(0.0, seconds) / rows)

    def observe_verify(self, rows: int, seconds: float) -> None:
        bucket = min(rows, MAX_ROWS)
        self.verify_by_tokens[bucket] = self._blend(bucket, self.verify_by_tokens.get(bucket), seconds)
        self.verify_samples[bucket] = self.verify_samples.get(bucket, 0) + 1
        self._version += 1

    @contextmanager
    def warming_up(self) -> Iterator[None]:
        """Within: every sample kept, each estimate their median (the engine's warm-up); after: moving averages."""
        self.warm_up_samples = {}
        try:
            yield
        finally:
            self.warm_up_samples = None

    def _blend(self, key: int | str, old: float | None, sample: float) -> float:
        if self.warm_up_samples is not None:
            kept = self.warm_up_samples.setdefault(key, [])
            kept.append(sample)
            return statistics.median(kept)
        return sample if old is None else (1 - self.alpha) * old + self.alpha * sample

    def verify_time(self, rows: int) -> float | None:
        """The verify time of `rows` scored rows on the monotone fit (`monotone_verify`), interpolated linearly
        between measured row counts."""
        fitted = self.monotone_verify()
        if not fitted:
            return None
        bucket = min(rows, MAX_ROWS)
        if bucket in fitted:
            return fitted[bucket]
        known = sorted(fitted)
        below = [b for b in known if b < bucket]
        above = [b for b in known if b > bucket]
        if below and above:  # linear interpolation
            lo, hi = below[-1], above[0]
            w = (bucket - lo) / (hi - lo)
            return (1 - w) * fitted[lo] + w * fitted[hi]
        return fitted[below[-1] if below else above[0]]

    def monotone_verify(self) -> dict[int, float]:
        """verify_by_tokens fitted non-decreasing in rows (pool adjacent violators; a row count weighs its samples,
        at most FIT_WEIGHT): scoring more rows never costs less, so one noisy estimate must not make its k look
        cheaper than a smaller one's (`bench spec` measured 0.150 s at 4 rows and 0.211 s at 5 between 0.156 s
        at 3 and 0.179 s at 17: auto then avoided k=4 for a spell's noise). Refitted after every new sample."""
        key = (id(self.verify_by_tokens), self._version, len(self.verify_by_tokens))
        if self._fit is None or self._fit[0] != key:
            pools: list[tuple[float, float, list[int]]] = []  # (value, weight, row counts pooled)
            for rows in sorted(self.verify_by_tokens):
                value, weight, members = self.verify_by_tokens[rows], float(
                    min(self.verify_samples.get(rows, 1), FIT_WEIGHT)), [rows]
                while pools and pools[-1][0] > value:
                    v, w, m = pools.pop()
                    value, weight, members = (v * w + value * weight) / (w + weight), w + weight, m + members
                pools.append((value, weight, members))
            self._fit = (key, {rows: value for value, _, members in pools for rows in members})
        return self._fit[1]


def _rate(stats: AcceptanceStats, prior: float, weight: float) -> float:
    """Per-draft acceptance rate, shrunk towards `prior` with `weight` pseudo-drafts."""
    return (stats.accepted + weight * prior) / (stats.accepted + stats.rejections + weight)


def depth_ratios(engine: AcceptanceStats, rate: float, k_max: int) -> list[float]:
    """c_2..c_kmax: how much of the survival at position i-1 the engine measured surviving position i
    (s_i / s_{i-1} over every request), each shrunk towards `rate` with PRIOR_ROUNDS pseudo-rounds; `rate` alone
    where the engine never reached position i (geometric)."""
    s = engine.survival()
    out = []
    for i in range(1, k_max):
        if i < len(s) and s[i - 1] > 0:
            ratio = min(1.0, s[i] / s[i - 1])
            out.append((engine.reached[i] * ratio + PRIOR_ROUNDS * rate) / (engine.reached[i] + PRIOR_ROUNDS))
        else:
            out.append(rate)
    return out


def blended_survival(own: AcceptanceStats, engine: AcceptanceStats, k_max: int) -> list[float]:
    """s_1..s_kmax: the request's per-position survival, shrunk towards its extrapolation: its own rate at
    position 1, then the engine's measured depth ratios (deep drafts survive more often than the first,
    given that the ones before survived: geometric would keep a request that learned only position 1 at k=1)."""
    rate = _rate(own, _rate(engine, PRIOR_SURVIVAL, PRIOR_ROUNDS), PRIOR_ROUNDS)
    prior = [rate]
    for ratio in depth_ratios(engine, rate, k_max):
        prior.append(prior[-1] * ratio)
    out = []
    for i in range(k_max):
        reached = own.reached[i] if i < len(own.reached) else 0
        survived = own.survived[i] if i < len(own.survived) else 0
        out.append((survived + PRIOR_ROUNDS * prior[i]) / (reached + PRIOR_ROUNDS))
    for i in range(1, k_max):  # survival cannot grow with depth
        out[i] = min(out[i], out[i - 1])
    return out


@dataclass
class AutoDecision:
    k: int
    reason: str
    rate: float | None = None  # the chosen k's expected tokens per second (None: a warm-up or probe round)


@dataclass(frozen=True)
class AutoInputs:
    """Everything auto's k for one request reads, taken on the engine thread for one round.

    `draft_cost_per_token`: measured seconds per draft step (None: not measured yet; 0 for n-gram).
    `batch`: requests in the round; the verify cost of k is read at batch * (catch_up + k) scored rows, as if
    every request picked the same k (at batch 8 on a CPU, 24 rows cost far more than 3)."""

    own: AcceptanceStats
    engine: AcceptanceStats
    cost: CostModel
    k_max: int
    catch_up: int
    rounds_at_zero: int
    probe_every: int
    free_fraction: float
    pressure_free_fraction: float
    draft_cost_per_token: float | None
    batch: int = 1
    tokens_left: int | None = None  # the request's output tokens still to come (None: unbounded)


def choose_k(inputs: AutoInputs) -> AutoDecision:
    """k* = argmax E[Y](k) / t_cycle(k) over the measured costs (module docstring)."""
    own, cost, k_max, catch_up = inputs.own, inputs.cost, inputs.k_max, inputs.catch_up
    rounds_at_zero, probe_every, batch = inputs.rounds_at_zero, inputs.probe_every, inputs.batch
    free_fraction, pressure_free_fraction = inputs.free_fraction, inputs.pressure_free_fraction
    draft_cost_per_token = inputs.draft_cost_per_token
    if k_max == 0:
        return AutoDecision(0, "no drafter")
    cap = 1 if free_fraction < pressure_free_fraction else k_max
    if not cost.verify_by_tokens:  # a row count never measured reads its neighbours' (verify_time)
        return AutoDecision(0, "warm-up: measuring plain-decode cost")
    bucket = min(batch * catch_up, MAX_ROWS)
    if draft_cost_per_token is None or (bucket < MAX_ROWS and not any(b > bucket for b in cost.verify_by_tokens)):
        return AutoDecision(min(2, cap), "warm-up: measuring draft and verify cost")
    # at a prompt's round (catch_up > 1) drafts look cheap next to the prefill, so the round drafts at nearly any
    # acceptance: that is the request's look at its own acceptance. Pricing them at the steady rate instead (kept
    # out, docs/speculation.md "A prompt's round and the last probe") kept a code prompt after a prose one from
    # ever drafting: the engine-wide rate said no, and the request never measured its own (what the look costs in the
    # draft cache's catch-up is priced apart: catch_up.py)
    rates = expected_rates(inputs, cap, catch_up)
    # PLAIN_MARGIN keeps speculating while plain decoding is not clearly faster; a request that speculated and fell
    # back learns nothing more while plain, so it speculates again at its probe or where a k is faster outright, not
    # on the verify times' jitter inside the margin (a cold prose request flipped back twice that way)
    fell_back = rounds_at_zero > 0 and own.proposed > 0
    best_k = _best_k(rates, 1.0 if fell_back else 1 / PLAIN_MARGIN)
    if best_k == 0:
        return _plain_or_probe(rates, rounds_at_zero, probe_every, "", inputs.tokens_left)
    reason = "memory pressure: k capped at 1" if cap < k_max and best_k == cap else "cost model"
    return AutoDecision(best_k, reason, rates[best_k])


def expected_rates(inputs: AutoInputs, cap: int, catch_up: int) -> list[float]:
    """Expected tokens per second at k = 0..cap for a round whose target catches up `catch_up` tokens:
    E[Y](k) / (k * draft step + verify of batch * (catch_up + k) rows). Needs a measured verify time."""
    survival = blended_survival(inputs.own, inputs.engine, inputs.k_max)
    draft = inputs.draft_cost_per_token or 0.0
    rates = []
    for k in range(0, cap + 1):
        t_verify = inputs.cost.verify_time(inputs.batch * (catch_up + k))
        assert t_verify is not None
        rates.append((1.0 + sum(survival[:k])) / (k * draft + t_verify))
    return rates


def _best_k(rates: list[float], leave_plain: float = PREFER_SMALLER) -> int:
    """The k of the highest rate, preferring a smaller k unless a larger one is clearly better: a k >= 1 replaces
    plain decoding (k=0) if its rate exceeds plain's times `leave_plain`, a larger k a smaller one's times
    PREFER_SMALLER."""
    best_k = 0
    for k, rate in enumerate(rates[1:], start=1):
        if rate > rates[best_k] * (leave_plain if best_k == 0 else PREFER_SMALLER):
            best_k = k
    return best_k


def _plain_or_probe(rates: list[float], rounds_at_zero: int, probe_every: int, prefix: str,
                    tokens_left: int | None = None) -> AutoDecision:
    """Plain decoding; a probe after `probe_every` plain rounds while more than half as many tokens are left to use
    what it learns (a probe near the end pays its draft's catch-up and a step for a few tokens at best)."""
    if rounds_at_zero >= probe_every and (tokens_left is None or 2 * tokens_left > probe_every):
        return AutoDecision(1, f"{prefix}probe: re-measuring acceptance after plain decoding")
    return AutoDecision(0, f"{prefix}fallback: plain decoding is faster ({rates[0]:.2f} tokens/s vs best "
                           f"speculative {max(rates[1:], default=0):.2f})", rates[0])


def lookup_wins(lookup: AutoDecision, model: AutoDecision) -> bool:
    """A model-drafted request's round: the n-gram lookup's chain (no draft cost) instead of the draft model's, where
    the lookup's own estimate drafts (k > 0, not a probe) at an expected rate no lower than the model's choice; a
    round the model spends measuring (its warm-up, its probe) goes to the lookup only if the lookup drafts at all."""
    if lookup.k == 0 or lookup.rate is None:
        return False
    return model.rate is None or model.k == 0 or lookup.rate >= model.rate


@dataclass(frozen=True)
class SeededInputs:
    """Everything a seeded request's k depends on: its own acceptance so far and its own limits.

    Deliberately without engine-wide acceptance, measured costs, batch size, catch-up or KV free fraction:
    those change with what runs beside the request and with timing. Build it with `of` (a snapshot).
    """

    accepted: int  # drafts accepted so far
    rejections: int  # rounds that rejected a draft
    reached: tuple[int, ...]  # AcceptanceStats.reached / survived: per draft position
    survived: tuple[int, ...]
    k_max: int  # the request's cap this round: min(engine k_max, tokens left - 1)
    rounds_at_zero: int  # its consecutive plain-decoding rounds
    probe_every: int  # the engine setting (the same command gives the same value)
    model_draft: bool  # False: n-gram, drafting costs nothing
    costs: NominalCosts = FLOAT32_COSTS  # the engine's table (its target dtype: the same command, the same table)
    tokens_left: int | None = None  # its output tokens still to come (None: unbounded)

    @classmethod
    def of(cls, own: AcceptanceStats, k_max: int, rounds_at_zero: int, probe_every: int,
           model_draft: bool, costs: NominalCosts = FLOAT32_COSTS, tokens_left: int | None = None) -> SeededInputs:
        return cls(own.accepted, own.rejections, tuple(own.reached), tuple(own.survived), k_max, rounds_at_zero,
                   probe_every, model_draft, costs, tokens_left)


def choose_k_seeded(inputs: SeededInputs) -> AutoDecision:
    """k for a seeded request: argmax E[Y](k) / t_nominal(k), with t_nominal(k) = k * draft step +
    verify of 1 + k tokens (the engine's NominalCosts), probing again after `probe_every` plain rounds. Reasons start
    with "seeded: "."""
    if inputs.k_max == 0:
        return AutoDecision(0, "seeded: no drafter")
    own = AcceptanceStats(accepted=inputs.accepted, rejections=inputs.rejections, reached=list(inputs.reached),
                          survived=list(inputs.survived))
    survival = blended_survival(own, AcceptanceStats(), inputs.k_max)  # no engine-wide rate: the prior
    draft = inputs.costs.draft_token if inputs.model_draft else 0.0
    rates = [(1.0 + sum(survival[:k])) / (k * draft + inputs.costs.verify_cost(1 + k))
             for k in range(inputs.k_max + 1)]
    best_k = _best_k(rates)
    if best_k == 0:
        return _plain_or_probe(rates, inputs.rounds_at_zero, inputs.probe_every, "seeded: ", inputs.tokens_left)
    return AutoDecision(best_k, "seeded: nominal cost model", rates[best_k])
