"""The statistics of `specserve check exact` (cluster/check/stats.py), without models.

Known values: the chi-square survival function has closed forms for df = 1 (erfc(sqrt(x/2))) and df = 2
(exp(-x/2)); critical values are the textbook table entries; the noncentral chi-square values were
computed with mpmath 1.3.0 (the Poisson-mixture series, nsum to convergence). The simulations are
seeded, so each run is deterministic; their tolerances are >= 4 standard errors.
"""

from __future__ import annotations

import math

import pytest
import torch

from cluster.check.stats import (
    binomial_p_value,
    binomial_power,
    chi2_isf,
    chi2_sf,
    chi_square_power,
    fit,
    ncx2_sf,
    pool_cells,
    samples_for_power,
)


@pytest.mark.parametrize("x", [0.1, 1.0, 3.841458820694124, 10.0, 30.0])
def test_chi2_sf_closed_forms(x: float) -> None:
    assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
    assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)


@pytest.mark.parametrize(("alpha", "df", "critical"), [
    (0.05, 1, 3.841459), (0.001, 1, 10.827566), (0.05, 10, 18.307038), (0.001, 5, 20.515006),
    (0.001, 10, 29.588298), (0.001, 35, 66.619),
])
def test_chi2_critical_values_from_tables(alpha: float, df: int, critical: float) -> None:
    assert chi2_isf(alpha, df) == pytest.approx(critical, abs=6e-4)  # the tables give 3 to 6 decimals
    assert chi2_sf(chi2_isf(alpha, df), df) == pytest.approx(alpha, rel=1e-8)


@pytest.mark.parametrize(("x", "df", "lam", "expected"), [
    (10.0, 3, 5.0, 0.293351352222548),
    (29.588, 10, 25.0, 0.66530310512819),
    (66.6, 35, 48.0, 0.845949527966934),
])
def test_noncentral_chi2_known_values(x: float, df: int, lam: float, expected: float) -> None:
    assert ncx2_sf(x, df, lam) == pytest.approx(expected, rel=1e-8)


def test_noncentral_chi2_matches_simulation() -> None:
    generator = torch.Generator().manual_seed(1)
    df, lam, x = 4, 9.0, 15.0
    means = torch.zeros(df, dtype=torch.float64)
    means[0] = math.sqrt(lam)
    draws = ((torch.randn(200_000, df, dtype=torch.float64, generator=generator) + means) ** 2).sum(-1)
    empirical = float((draws > x).double().mean())
    assert ncx2_sf(x, df, lam) == pytest.approx(empirical, abs=4 * math.sqrt(0.25 / 200_000))
    assert ncx2_sf(x, df, 0.0) == pytest.approx(chi2_sf(x, df), rel=1e-12)


def test_power_grows_with_samples_and_shrinks_with_df() -> None:
    powers = [chi_square_power(n, 10, 1e-3, 0.05) for n in (100, 500, 1000, 2000, 4000, 8000)]
    assert all(a < b for a, b in zip(powers, powers[1:], strict=False))
    assert powers[0] < 0.05 and powers[-1] > 0.99
    by_df = [chi_square_power(2000, df, 1e-3, 0.05) for df in (1, 5, 20, 80)]
    assert all(a > b for a, b in zip(by_df, by_df[1:], strict=False))
    assert chi_square_power(2000, 10, 1e-3, 1e-9) == pytest.approx(1e-3, rel=1e-3)  # no shift: power = alpha


def test_samples_for_power_is_the_smallest_count() -> None:
    needed = samples_for_power(lambda n: chi_square_power(n, 10, 1e-3, 0.05), 0.8)
    assert needed is not None
    assert chi_square_power(needed, 10, 1e-3, 0.05) >= 0.8 > chi_square_power(needed - 1, 10, 1e-3, 0.05)
    assert samples_for_power(lambda n: 0.0, 0.8) is None


def test_power_matches_simulation_against_the_least_favourable_alternative() -> None:
    """p uniform over 10 tokens; the alternative moves total variation 0.1 proportionally to p (half the
    tokens x1.2, half x0.8): lambda = 4 N tv^2 exactly, so the simulated rejection rate is the stated power."""
    n, tv, alpha, runs = 600, 0.1, 1e-3, 2000
    p = torch.full((10,), 0.1, dtype=torch.float64)
    alternative = p * torch.tensor([1.2] * 5 + [0.8] * 5, dtype=torch.float64)
    generator = torch.Generator().manual_seed(2)
    draws = torch.multinomial(alternative, n * runs, replacement=True, generator=generator).view(runs, n)
    rejected = sum(fit(row.tolist(), p).p_value < alpha for row in draws)
    stated = chi_square_power(n, 9, alpha, tv)
    assert 0.5 < stated < 0.8
    assert rejected / runs == pytest.approx(stated, abs=4 * math.sqrt(stated * (1 - stated) / runs) + 0.02)


def test_false_alarm_rate_with_pooled_cells_is_alpha() -> None:
    """Samples from p itself (a long tail that gets pooled) are rejected at about the nominal rate."""
    alpha, n, runs = 0.05, 300, 2000
    p = torch.cat([torch.tensor([0.3, 0.2, 0.15, 0.1]), torch.full((200,), 0.25 / 200)]).double()
    generator = torch.Generator().manual_seed(3)
    draws = torch.multinomial(p, n * runs, replacement=True, generator=generator).view(runs, n)
    rate = sum(fit(row.tolist(), p).p_value < alpha for row in draws) / runs
    assert rate == pytest.approx(alpha, abs=4 * math.sqrt(alpha * (1 - alpha) / runs))


def test_pool_cells_pools_rare_tokens_and_keeps_every_cell_at_five() -> None:
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02, 0.0], dtype=torch.float64)
    counts = torch.tensor([48, 33, 9, 6, 2, 2, 0])
    cells = pool_cells(counts, probs)  # N = 100: expected 50, 30, 10, 5, 3, 2 -> 3 and 2 pooled (5)
    assert [c.tokens for c in cells] == [(0,), (1,), (2,), (3,), (4, 5)]
    assert [c.observed for c in cells] == [48, 33, 9, 6, 4]
    assert [c.expected for c in cells] == pytest.approx([50, 30, 10, 5, 5])
    assert sum(c.expected for c in cells) == pytest.approx(100)


def test_pool_cells_merges_the_smallest_cell_into_a_pool_under_five() -> None:
    probs = torch.tensor([0.6, 0.3, 0.06, 0.04], dtype=torch.float64)
    counts = torch.tensor([60, 30, 6, 4])
    cells = pool_cells(counts, probs)  # expected 60, 30, 6, 4: the pool (4) takes the 6 -> 10
    assert [c.tokens for c in cells] == [(0,), (1,), (2, 3)]
    assert [c.expected for c in cells] == pytest.approx([60, 30, 10])
    assert all(c.expected >= 5 for c in cells)


def test_fit_statistic_tv_and_worst_cells_by_hand() -> None:
    probs = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    result = fit([0] * 60 + [1] * 20 + [2] * 20, probs)
    # expected 50, 25, 25: X^2 = 100/50 + 25/25 + 25/25 = 4, df = 2, p = exp(-2)
    assert result.test == "chi-square" and result.df == 2
    assert result.statistic == pytest.approx(4.0)
    assert result.p_value == pytest.approx(math.exp(-2.0))
    assert result.tv == pytest.approx(0.1)
    assert result.worst(1)[0].tokens == (0,)
    assert result.outside_support == 0


def test_a_token_outside_the_support_fails_at_once() -> None:
    probs = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    result = fit([0] * 50 + [1] * 49 + [2], probs)
    assert result.outside_support == 1 and result.p_value == 0.0


def test_point_mass_is_exact_match() -> None:
    probs = torch.zeros(5, dtype=torch.float64)
    probs[3] = 1.0
    good = fit([3] * 40, probs)
    assert good.test == "binomial" and good.p_value == 1.0 and good.tv == 0.0
    assert good.power(1e-3, 0.1) == pytest.approx(1 - 0.9 ** 40)
    bad = fit([3] * 39 + [1], probs)
    assert bad.p_value == 0.0 and bad.outside_support == 1


def test_near_point_mass_uses_the_exact_binomial_test() -> None:
    """p(top) = 0.999: every other token together expects 0.2 of 200 samples, so the chi-square cells would
    collapse into one; the binomial test of the off-top count takes over."""
    probs = torch.tensor([0.999, 0.0006, 0.0004], dtype=torch.float64)
    ok = fit([0] * 200, probs)
    assert ok.test == "binomial" and ok.p_value == pytest.approx(1.0)
    assert ok.power(1e-3, 0.1) > 0.99
    off = fit([0] * 197 + [1, 2, 1], probs)
    assert off.statistic == 3 and off.p_value == pytest.approx(binomial_p_value(3, 200, 0.001))
    assert off.p_value < 2e-3


def test_binomial_p_values_and_power() -> None:
    assert binomial_p_value(0, 10, 0.5) == pytest.approx(2 / 1024)
    assert binomial_p_value(10, 10, 0.5) == pytest.approx(2 / 1024)
    assert binomial_p_value(5, 10, 0.5) == pytest.approx(1.0)
    assert binomial_p_value(1, 10, 0.5) == pytest.approx(22 / 1024)
    assert binomial_power(16, 0.0, 1e-3, 0.1) == pytest.approx(1 - 0.9 ** 16)
    assert binomial_power(50, 0.3, 1e-3, 0.1) < binomial_power(400, 0.3, 1e-3, 0.1)
