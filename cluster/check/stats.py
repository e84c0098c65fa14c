"""The statistics of `specserve check exact`: Pearson's chi-square goodness of fit with pooled cells, its
p-value, the power against a stated total variation, total variation and the worst cells. torch float64,
no scipy.

One test: N sampled tokens against a reference distribution p over the vocabulary.

  cells      each token with expected count N p(v) >= 5 is its own cell; the others are pooled into one
             cell ("other"); while that pool expects < 5 the smallest cell joins it.
  statistic  X^2 = sum_cells (O - E)^2 / E,  df = cells - 1,  p-value = Q(df/2, X^2/2) (the chi-square
             survival function; torch.special.gammaincc).
  support    a token with p(v) = 0 cannot be sampled: observing one fails the test whatever X^2 says.
  binomial   when the cells collapse into one (p nearly a point mass: every token but the most likely one
             together expects < 5 samples), the test is exact instead: X = the samples off the most likely
             token ~ Binomial(N, eps), eps = 1 - p(top), two-sided p-value (the sum of the probabilities of
             the outcomes no more likely than X). A point mass (greedy, top-k 1: eps = 0) is exact match:
             any other token fails.

Power (the chance the test rejects when the sampled distribution differs from p): for an alternative
pi_1 whose total variation from p on the cells is delta, the noncentrality of X^2 is
  lambda = N sum_cells (pi_1 - p)^2 / p >= N (sum_cells |pi_1 - p|)^2 = 4 N delta^2      (Cauchy-Schwarz),
with equality for the least favourable alternative (the shift proportional to p, half the mass up, half
down). The stated power is P(chi2'(df, lambda = 4 N delta^2) > chi2_{1-alpha}(df)), the asymptotic
(noncentral chi-square) power against EVERY alternative at total variation >= delta on the cells; a
shift inside the pooled cell is invisible to the test. Binomial test: the smaller of its exact power
against eps + delta and eps - delta (the alternatives at total variation delta on its two cells); for a
point mass 1 - (1 - delta)^N, the chance that at least one of N samples lands off the mass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

MIN_EXPECTED = 5.0  # cells expecting fewer samples are pooled (the usual validity rule of the chi-square)
WORST_CELLS = 5


def chi2_sf(x: float, df: int) -> float:
    """P(chi2(df) > x), df >= 1."""
    assert df >= 1, f"df must be >= 1, got {df}"
    if x <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi2_isf(alpha: float, df: int) -> float:
    """The critical value c with P(chi2(df) > c) = alpha (bisection on chi2_sf, to ~1e-10 relative)."""
    assert 0 < alpha < 1 and df >= 1, (alpha, df)
    low, high = 0.0, float(df) + 10.0
    while chi2_sf(high, df) > alpha:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if chi2_sf(mid, df) > alpha:
            low = mid
        else:
            high = mid
        if high - low <= 1e-10 * high:
            break
    return (low + high) / 2


def ncx2_sf(x: float, df: int, lam: float) -> float:
    """P(chi2'(df, lam) > x): the noncentral chi-square as a Poisson(lam/2) mixture of central ones,
    sum_j Pois(j; lam/2) Q(df/2 + j, x/2), summed over j within ~12 standard deviations of lam/2."""
    assert df >= 1 and lam >= 0, (df, lam)
    if x <= 0:
        return 1.0
    if lam == 0:
        return chi2_sf(x, df)
    half = lam / 2
    spread = 12 * math.sqrt(half) + 30
    j = torch.arange(max(0, int(half - spread)), int(half + spread) + 1, dtype=torch.float64)
    log_weights = j * math.log(half) - half - torch.lgamma(j + 1)
    tails = torch.special.gammaincc(df / 2 + j, torch.full_like(j, x / 2))
    return float((log_weights.exp() * tails).sum().clamp(0.0, 1.0))


def chi_square_power(samples: int, df: int, alpha: float, tv: float) -> float:
    """The chi-square test's power (module docstring) with `samples` samples and `df` >= 1 degrees of freedom
    against every alternative at total variation >= tv."""
    if samples <= 0:
        return 0.0
    return ncx2_sf(chi2_isf(alpha, df), df, 4.0 * samples * tv * tv)


def binomial_pmf(n: int, eps: float) -> torch.Tensor:
    """float64 [n + 1]: P(X = x) for X ~ Binomial(n, eps)."""
    x = torch.arange(n + 1, dtype=torch.float64)
    if eps <= 0.0 or eps >= 1.0:
        return (x == (0 if eps <= 0.0 else n)).double()
    log_pmf = (math.lgamma(n + 1) - torch.lgamma(x + 1) - torch.lgamma(n - x + 1)
               + x * math.log(eps) + (n - x) * math.log1p(-eps))
    return log_pmf.exp()


def binomial_p_values(n: int, eps: float) -> torch.Tensor:
    """float64 [n + 1]: the two-sided p-value of each outcome x of Binomial(n, eps): the probability of the
    outcomes no more likely than x (relative tolerance 1e-7, as scipy's binomtest)."""
    pmf = binomial_pmf(n, eps)
    ordered, _ = torch.sort(pmf)
    cumulative = ordered.cumsum(0)
    index = torch.searchsorted(ordered, pmf * (1 + 1e-7), right=True) - 1
    return cumulative[index].clamp(max=1.0)


def binomial_p_value(x: int, n: int, eps: float) -> float:
    return float(binomial_p_values(n, eps)[x])


def binomial_power(samples: int, eps: float, alpha: float, tv: float) -> float:
    """The exact binomial test's power at level alpha against the alternatives eps +- tv (the smaller one)."""
    if samples <= 0:
        return 0.0
    reject = binomial_p_values(samples, eps) < alpha
    alternatives = [a for a in (eps + tv, eps - tv) if 0.0 <= a <= 1.0] or [min(1.0, eps + tv)]
    return min(float(binomial_pmf(samples, a)[reject].sum()) for a in alternatives)


def samples_for_power(power_of: Callable[[int], float], target: float, limit: int = 10**7) -> int | None:
    """The smallest sample count N with power_of(N) >= target (bisection: power grows with N, up to the
    discreteness of an exact test); None past `limit`."""
    if power_of(limit) < target:
        return None
    low, high = 0, 1
    while power_of(high) < target:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if power_of(mid) >= target:
            high = mid
        else:
            low = mid
    return high


@dataclass(frozen=True)
class Cell:
    """One chi-square cell: a token, or the pooled rare tokens (`tokens` holds them all)."""

    tokens: tuple[int, ...]
    observed: int
    expected: float

    @property
    def pooled(self) -> bool:
        return len(self.tokens) > 1

    @property
    def contribution(self) -> float:
        """(O - E)^2 / E; a cell expecting nothing contributes 0 when empty, infinity otherwise."""
        if self.expected <= 0:
            return 0.0 if self.observed == 0 else math.inf
        return (self.observed - self.expected) ** 2 / self.expected


@dataclass(frozen=True)
class Fit:
    """A goodness-of-fit test of N samples against a reference distribution (module docstring)."""

    test: str  # "chi-square" or "binomial"
    samples: int
    support: int  # tokens of positive reference probability
    cells: tuple[Cell, ...]
    outside_support: int  # samples the reference gives probability 0
    statistic: float  # chi-square: X^2; binomial: the samples off the most likely token
    df: int  # chi-square: cells - 1; binomial: 1
    p_value: float
    tv: float  # total variation between the observed frequencies and the reference, on the cells
    tv_noise: float  # what tv is expected to be from sampling alone, for a correct sampler (normal approx.)
    rest_mass: float  # binomial: eps = 1 - p(most likely token); chi-square: 0

    def worst(self, count: int = WORST_CELLS) -> list[Cell]:
        """The cells that contribute most to X^2 (binomial: the off-top cell first)."""
        return sorted(self.cells, key=lambda c: c.contribution, reverse=True)[:count]

    def power_at(self, samples: int, alpha: float, tv: float) -> float:
        """The power this test would have with `samples` samples (same cells, same df)."""
        if self.test == "binomial":
            return binomial_power(samples, self.rest_mass, alpha, tv)
        return chi_square_power(samples, self.df, alpha, tv)

    def power(self, alpha: float, tv: float) -> float:
        return self.power_at(self.samples, alpha, tv)

    def samples_for_power(self, alpha: float, tv: float, target: float) -> int | None:
        """Samples this test would need to reach `target` power (None: out of reach)."""
        return samples_for_power(lambda n: self.power_at(n, alpha, tv), target)


def pool_cells(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = MIN_EXPECTED) -> list[Cell]:
    """Cells over the reference's support: tokens expecting >= min_expected samples alone, the rest pooled;
    while the pool expects fewer than min_expected, the smallest single cell joins it. `counts` [V] observed,
    `probs` [V] reference probabilities (normalized here)."""
    probs = probs.double()
    probs = probs / probs.sum()
    total = int(counts.sum())
    support = (probs > 0).nonzero().flatten()
    expected = probs[support] * total
    order = torch.argsort(expected, descending=True, stable=True)
    support, expected = support[order], expected[order]
    alone = int((expected >= min_expected).sum())
    pool_expected = float(expected[alone:].sum())
    while alone > 0 and alone < len(support) and pool_expected < min_expected:
        alone -= 1
        pool_expected += float(expected[alone])
    observed = counts[support]
    cells = [Cell((int(t),), int(o), float(e)) for t, o, e in zip(support[:alone], observed[:alone], expected[:alone],
                                                                   strict=True)]
    if alone < len(support):
        cells.append(Cell(tuple(int(t) for t in support[alone:]), int(observed[alone:].sum()), pool_expected))
    return cells


def fit(tokens: list[int], probs: torch.Tensor, min_expected: float = MIN_EXPECTED) -> Fit:
    """The test of the sampled `tokens` against the reference `probs` [V]: Pearson's chi-square over pooled
    cells, or the exact binomial test when those collapse into one cell (module docstring)."""
    vocab = probs.numel()
    ids = torch.as_tensor(tokens, dtype=torch.long)
    assert ids.numel() > 0, "no samples"
    assert int(ids.min()) >= 0 and int(ids.max()) < vocab, "a sampled token lies outside the vocabulary"
    probs = probs.double() / probs.double().sum()
    counts = torch.bincount(ids, minlength=vocab)
    n = ids.numel()
    support = int((probs > 0).sum())
    cells = pool_cells(counts, probs, min_expected)
    test, rest_mass = "chi-square", 0.0
    if len(cells) == 1:
        test = "binomial"
        top = int(probs.argmax())
        rest_mass = max(0.0, 1.0 - float(probs[top]))
        rest = tuple(t for t in cells[0].tokens if t != top)
        cells = [Cell((top,), int(counts[top]), n * (1.0 - rest_mass))]
        if rest:
            cells.append(Cell(rest, int(counts[list(rest)].sum()), n * rest_mass))
    inside = sum(c.observed for c in cells)
    if test == "binomial":
        statistic, df = float(n - int(counts[cells[0].tokens[0]])), 1
        p_value = binomial_p_value(int(statistic), n, rest_mass)
    else:
        statistic, df = float(sum(c.contribution for c in cells)), len(cells) - 1
        p_value = chi2_sf(statistic, df)
    if inside < n:
        p_value = 0.0  # a token the reference cannot emit
    tv = 0.5 * (sum(abs(c.observed - c.expected) for c in cells) + (n - inside)) / n
    tv_noise = 0.5 * sum(math.sqrt(2 * max(0.0, (c.expected / n) * (1 - c.expected / n)) / (math.pi * n))
                         for c in cells)
    return Fit(test=test, samples=n, support=support, cells=tuple(cells), outside_support=n - inside,
               statistic=statistic, df=df, p_value=p_value, tv=tv, tv_noise=tv_noise, rest_mass=rest_mass)
