"""Auto speculation policy: picks the k that maximises expected tokens per second, falls back to plain
decoding when speculation does not pay, probes again later, and shrinks k under memory pressure."""

from __future__ import annotations

import dataclasses
from dataclasses import fields

import pytest

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.spec_policy import (
    BFLOAT16_COSTS,
    FIT_WEIGHT,
    FLOAT32_COSTS,
    Q4_COSTS,
    Q4_INT8_DRAFT_COSTS,
    AutoInputs,
    CostModel,
    NominalCosts,
    SeededInputs,
    blended_survival,
    choose_k,
    choose_k_seeded,
    depth_ratios,
    nominal_costs,
)


def stats_with(survival_per_round: list[int], proposed: int, rounds: int) -> AcceptanceStats:
    stats = AcceptanceStats()
    for accepted in survival_per_round * rounds:
        stats.record(accepted, proposed, "greedy")
    return stats


def cost(draft: float, verify: dict[int, float]) -> CostModel:
    model = CostModel()
    model.draft_token = draft
    model.verify_by_tokens = dict(verify)
    return model


def choose(own: AcceptanceStats, c: CostModel, **kw) -> tuple[int, str]:
    args = dict(k_max=4, catch_up=1, rounds_at_zero=0, probe_every=16, free_fraction=1.0,
                pressure_free_fraction=0.1, draft_cost_per_token=c.draft_token)
    args.update(kw)
    d = choose_k(AutoInputs(own, AcceptanceStats(), c, **args))
    return d.k, d.reason


def test_cheap_draft_and_high_acceptance_speculates_deep() -> None:
    own = stats_with([4], proposed=4, rounds=50)  # every draft accepted
    k, reason = choose(own, cost(0.01, {1: 0.30, 2: 0.31, 3: 0.32, 4: 0.33, 5: 0.34}))
    assert k == 4 and reason == "cost model"


def test_expensive_draft_or_low_acceptance_falls_back_to_plain_decoding() -> None:
    own = stats_with([0], proposed=4, rounds=50)  # nothing ever accepted
    k, reason = choose(own, cost(0.10, {1: 0.30, 2: 0.45, 3: 0.50, 4: 0.55, 5: 0.60}))
    assert k == 0 and reason.startswith("fallback")


def test_plain_decoding_is_probed_again_later() -> None:
    own = stats_with([0], proposed=4, rounds=50)
    k, reason = choose(own, cost(0.10, {1: 0.30, 5: 0.60}), rounds_at_zero=16)
    assert k == 1 and reason.startswith("probe")


def test_a_probe_needs_tokens_left_to_use_what_it_learns() -> None:
    """A probe pays its draft's catch-up and a step; near the end of the output its gain is a few tokens at best."""
    own = stats_with([0], proposed=4, rounds=50)
    c = cost(0.10, {1: 0.30, 5: 0.60})
    assert choose(own, c, rounds_at_zero=16, tokens_left=9)[0] == 1
    k, reason = choose(own, c, rounds_at_zero=16, tokens_left=8)
    assert k == 0 and reason.startswith("fallback")
    seeded = SeededInputs.of(own, 4, 16, probe_every=16, model_draft=True, tokens_left=8)
    assert choose_k_seeded(seeded).k == 0
    assert choose_k_seeded(dataclasses.replace(seeded, tokens_left=40)).k == 1


def test_a_request_that_fell_back_leaves_plain_decoding_at_its_probe_not_inside_the_margin() -> None:
    own = stats_with([1, 0, 0, 0], proposed=1, rounds=50)  # a quarter of its first drafts accepted
    c = cost(0.05, {1: 0.30, 2: 0.33, 3: 0.40, 4: 0.47, 5: 0.54})
    rate_plain, rate_k1 = 1 / 0.30, (1 + 0.25) / (0.05 + 0.33)
    assert 1 / 1.05 < rate_k1 / rate_plain < 1.0  # k=1 a little slower than plain: inside PLAIN_MARGIN
    assert choose(own, c) == (1, "cost model")  # speculating: it stays
    k, reason = choose(own, c, rounds_at_zero=3)  # fell back: plain until the probe
    assert k == 0 and reason.startswith("fallback")
    k, reason = choose(own, c, rounds_at_zero=16)
    assert k == 1 and reason.startswith("probe")
    assert choose(AcceptanceStats(), c, rounds_at_zero=3)[0] >= 1  # never speculated: the margin still applies


def test_memory_pressure_caps_k() -> None:
    own = stats_with([4], proposed=4, rounds=50)
    k, reason = choose(own, cost(0.01, {1: 0.30, 5: 0.34}), free_fraction=0.05)
    assert k == 1 and "memory pressure" in reason


def test_warm_up_measures_plain_then_speculative_cost() -> None:
    k, reason = choose(AcceptanceStats(), CostModel())
    assert k == 0 and "plain-decode cost" in reason
    k, reason = choose(AcceptanceStats(), cost(None, {1: 0.3}))  # type: ignore[arg-type]
    assert k == 2 and "draft and verify cost" in reason


def test_ngram_costs_nothing_to_draft() -> None:
    own = stats_with([2], proposed=4, rounds=50)  # two of four survive
    c = cost(None, {1: 0.30, 5: 0.60})  # type: ignore[arg-type]
    d = choose_k(AutoInputs(own, AcceptanceStats(), c, k_max=4, catch_up=1, rounds_at_zero=0, probe_every=16,
                 free_fraction=1.0, pressure_free_fraction=0.1, draft_cost_per_token=0.0))
    assert d.k >= 2 and d.reason == "cost model"


def test_survival_is_per_position_and_monotone() -> None:
    own = stats_with([1, 3], proposed=3, rounds=100)  # position 1 always, 2 and 3 half of the time
    s = blended_survival(own, AcceptanceStats(), 3)
    assert s[0] > 0.95 and 0.4 < s[1] < 0.6 and 0.4 < s[2] < 0.6
    assert s[0] >= s[1] >= s[2]


def test_cost_model_interpolates_verify_time() -> None:
    c = cost(0.01, {1: 0.3, 5: 0.7})
    assert abs(c.verify_time(3) - 0.5) < 1e-9
    assert c.verify_time(9) == 0.7


def test_unmeasured_positions_follow_the_measured_acceptance_rate() -> None:
    """A request that kept every draft at k=1 expects deeper drafts to survive and tries a larger k;
    one that lost half of them at k=1 does not."""
    c = cost(0.047, {1: 0.167, 2: 0.169, 3: 0.209, 4: 0.254, 5: 0.373})  # Qwen 1.5B / 0.5B fp16 draft
    kept = stats_with([1], proposed=1, rounds=20)
    s = blended_survival(kept, AcceptanceStats(), 4)
    assert s[0] > 0.95 and s[3] > 0.7
    d = choose_k(AutoInputs(kept, AcceptanceStats(), c, k_max=4, catch_up=1, rounds_at_zero=0, probe_every=16,
                 free_fraction=1.0, pressure_free_fraction=0.1, draft_cost_per_token=0.047))
    assert d.k >= 2, d
    half = stats_with([0, 1], proposed=1, rounds=20)
    s = blended_survival(half, AcceptanceStats(), 4)
    assert 0.4 < s[0] < 0.6 and s[1] < 0.35
    d = choose_k(AutoInputs(half, AcceptanceStats(), c, k_max=4, catch_up=1, rounds_at_zero=0, probe_every=16,
                 free_fraction=1.0, pressure_free_fraction=0.1, draft_cost_per_token=0.047))
    assert d.k <= 1, d


def test_verify_cost_is_read_at_the_rows_of_the_whole_batch() -> None:
    """Batch 1: 2-3 rows cost ~1.1x one row, so speculation pays. Batch 8: the library's GEMM is compute
    bound, 16 rows cost 2x 8 rows, so the same acceptance does not pay and auto decodes plainly."""
    c = cost(0.03, {1: 0.20, 2: 0.20, 3: 0.22, 8: 0.50, 16: 1.00, 24: 1.40, 32: 1.80, 40: 2.20})
    own = stats_with([0, 1, 2, 2, 2], proposed=2, rounds=20)  # s_1 = 0.8, s_2 = 0.6
    args = dict(k_max=4, catch_up=1, rounds_at_zero=0, probe_every=16, free_fraction=1.0,
                pressure_free_fraction=0.1, draft_cost_per_token=0.03)
    assert choose_k(AutoInputs(own, AcceptanceStats(), c, batch=1, **args)).k >= 1  # type: ignore[arg-type]
    assert choose_k(AutoInputs(own, AcceptanceStats(), c, batch=8, **args)).k == 0  # type: ignore[arg-type]


def seeded_k(own: AcceptanceStats, k_max: int = 4, rounds_at_zero: int = 0, model_draft: bool = True) -> tuple[int, str]:
    d = choose_k_seeded(SeededInputs.of(own, k_max, rounds_at_zero, probe_every=16, model_draft=model_draft))
    return d.k, d.reason


def test_seeded_k_is_a_function_of_the_requests_own_history_only() -> None:
    """Across engine-wide acceptance, measured costs, batch sizes and free fractions that move the unseeded
    decision for this history, the seeded decision is one k: its inputs hold nothing of those."""
    assert {f.name for f in fields(SeededInputs)} == {
        "accepted", "rejections", "reached", "survived", "k_max", "rounds_at_zero", "probe_every", "model_draft",
        "costs", "tokens_left"}  # costs: the engine's table, by its target dtype (the command), never by timing
    own = stats_with([0, 1, 2, 2, 2], proposed=2, rounds=20)  # s_1 = 0.8, s_2 = 0.6
    worlds = [(engine, c, batch, free)
              for engine in (AcceptanceStats(), stats_with([0], proposed=4, rounds=200))
              for c in (cost(0.01, {1: 0.2, 128: 0.3}), cost(0.03, {1: 0.20, 2: 0.20, 3: 0.22, 8: 0.50, 16: 1.00,
                                                                     24: 1.40, 32: 1.80, 40: 2.20}))
              for batch in (1, 8)
              for free in (1.0, 0.05)]
    unseeded = {choose_k(AutoInputs(own, engine, c, k_max=4, catch_up=1, rounds_at_zero=0, probe_every=16, free_fraction=free,
                         pressure_free_fraction=0.1, draft_cost_per_token=c.draft_token, batch=batch)).k
                for engine, c, batch, free in worlds}
    assert len(unseeded) > 1  # these worlds do change the engine-wide decision
    decisions = {seeded_k(own) for _ in worlds}
    assert len(decisions) == 1
    ((k, reason),) = decisions
    assert k >= 1 and reason == "seeded: nominal cost model"


def test_seeded_inputs_are_a_snapshot_and_follow_the_requests_own_acceptance() -> None:
    own = AcceptanceStats()
    inputs = SeededInputs.of(own, 4, 0, probe_every=16, model_draft=True)
    fresh = choose_k_seeded(inputs)
    assert fresh.k >= 1 and fresh.reason == "seeded: nominal cost model"  # the prior: speculation pays
    for _ in range(50):
        own.record(0, 4, "exact")  # the request's later rounds do not change an inputs value taken before
    assert choose_k_seeded(inputs) == fresh
    assert seeded_k(own)[0] == 0 and seeded_k(own)[1].startswith("seeded: fallback")
    assert seeded_k(own, rounds_at_zero=16) == (1, "seeded: probe: re-measuring acceptance after plain decoding")
    kept = stats_with([4], proposed=4, rounds=50)
    assert seeded_k(kept)[0] >= 3
    assert seeded_k(kept, k_max=2)[0] == 2
    assert seeded_k(kept, k_max=0) == (0, "seeded: no drafter")


def test_seeded_ngram_drafts_cost_nothing() -> None:
    """Half of the first drafts survive: with a draft model's nominal step cost k stays small, n-gram goes deeper."""
    own = stats_with([0, 1, 2, 3], proposed=4, rounds=20)
    assert seeded_k(own, model_draft=False)[0] > seeded_k(own, model_draft=True)[0]


def test_seeded_costs_follow_the_target_dtype() -> None:
    """bfloat16 scores up to 16 tokens for about one token's cost but its draft step is dearer (0.45 vs 0.14):
    free n-gram drafts go deeper than under float32's table, model drafts stay shallower."""
    assert nominal_costs("bfloat16") is BFLOAT16_COSTS and nominal_costs("float32", "float16") is FLOAT32_COSTS
    assert nominal_costs("q4", "q4") is Q4_COSTS and Q4_COSTS.verify_cost(9) == 3.0
    q4_int8 = nominal_costs("q4", "int8")  # an int8 draft beside a q4 target (one stream on an AMX CPU)
    assert q4_int8 is Q4_INT8_DRAFT_COSTS and q4_int8.draft_token > Q4_COSTS.draft_token
    costs = [q4_int8.verify_cost(rows) for rows in range(1, 40)]
    assert costs == sorted(costs), costs  # the table and what follows it never fall with rows
    assert nominal_costs("bfloat16", "int8").draft_token < BFLOAT16_COSTS.draft_token
    assert BFLOAT16_COSTS.verify_cost(9) == 1.1 and FLOAT32_COSTS.verify_cost(9) == 9 / 4

    def k(history: list[int], model_draft: bool, costs: NominalCosts) -> int:
        own = stats_with(history, proposed=4, rounds=30)
        return choose_k_seeded(SeededInputs.of(own, 8, 0, 16, model_draft=model_draft, costs=costs)).k

    assert k([2, 3, 4], False, BFLOAT16_COSTS) > k([2, 3, 4], False, FLOAT32_COSTS)
    assert k([2, 3, 4], True, BFLOAT16_COSTS) < k([2, 3, 4], True, FLOAT32_COSTS)


def test_deeper_positions_follow_the_engine_measured_depth_ratios() -> None:
    """A request that measured only position 1, at a low rate: geometric extrapolation (no engine history)
    says deeper drafts rarely survive; an engine whose requests kept deeper drafts once the first survived
    (conditional survival 0.9) raises that prior, and with it the k auto picks."""
    low = stats_with([0, 0, 1], proposed=1, rounds=60)  # s_1 = 1/3
    engine = stats_with([0] * 100 + [1] * 10 + [2] * 9 + [3] * 9 + [4] * 72, proposed=4, rounds=2)  # 0.5 .45 .4 .36
    ratios = depth_ratios(engine, 0.4, 4)
    assert all(r > 0.7 for r in ratios), ratios
    alone = blended_survival(low, AcceptanceStats(), 4)
    with_engine = blended_survival(low, engine, 4)
    assert abs(alone[0] - with_engine[0]) < 0.05  # position 1 is the request's own
    assert with_engine[2] > 2 * alone[2] and with_engine[3] > 2 * alone[3]
    assert all(a >= b for a, b in zip(with_engine, with_engine[1:], strict=False))
    c = cost(0.01, {1: 0.10, 2: 0.10, 3: 0.105, 4: 0.11, 5: 0.115})
    args = dict(k_max=4, catch_up=1, rounds_at_zero=0, probe_every=16, free_fraction=1.0,
                pressure_free_fraction=0.1, draft_cost_per_token=0.01)
    k_alone = choose_k(AutoInputs(low, AcceptanceStats(), c, **args)).k  # type: ignore[arg-type]
    k_engine = choose_k(AutoInputs(low, engine, c, **args)).k  # type: ignore[arg-type]
    assert k_engine > k_alone, (k_alone, k_engine)


def test_plain_decoding_must_win_by_the_margin() -> None:
    """Measured costs: k=1 modelled 3% slower than plain keeps speculating (plain rounds learn no acceptance, and
    the costs compared were timed at other moments); 15% slower falls back to plain."""
    args = dict(k_max=1, catch_up=1, rounds_at_zero=0, probe_every=16, free_fraction=1.0,
                pressure_free_fraction=0.1, draft_cost_per_token=0.02)
    own = stats_with([0, 1], proposed=1, rounds=50)  # s_1 = 0.5
    close = cost(0.02, {1: 0.100, 2: 0.135})  # plain 10.0 tokens/s, k=1 1.5 / 0.155 = 9.7
    assert choose_k(AutoInputs(own, AcceptanceStats(), close, **args)).k == 1  # type: ignore[arg-type]
    clear = cost(0.02, {1: 0.100, 2: 0.155})  # k=1 1.5 / 0.175 = 8.6
    assert choose_k(AutoInputs(own, AcceptanceStats(), clear, **args)).k == 0  # type: ignore[arg-type]
    seeded = SeededInputs(25, 25, (50,), (25,), 1, 0, 16, True, NominalCosts("t", (1.0, 1.35), 1, 0.2))
    assert choose_k_seeded(seeded).k == 0  # seeded requests keep the plain 2% rule (fixed costs, no noise)


def test_warm_up_estimates_are_medians_then_moving_averages() -> None:
    c = CostModel()
    with c.warming_up():
        for seconds in (0.50, 0.14, 0.18, 0.17):  # a first call paying one-time costs, then noise
            c.observe_verify(2, seconds)
        for seconds in (0.09, 0.04, 0.05):
            c.observe_draft(1, seconds)
        assert c.verify_by_tokens[2] == pytest.approx(0.175) and c.draft_token == pytest.approx(0.05)
    assert c.warm_up_samples is None
    c.observe_verify(2, 0.275)
    assert c.verify_by_tokens[2] == pytest.approx(0.8 * 0.175 + 0.2 * 0.275)


def test_verify_costs_are_fitted_non_decreasing_in_rows() -> None:
    """A noisy estimate below a smaller row count's is pooled with it (the bench's measured costs, seconds)."""
    measured = {1: 0.1555, 2: 0.1691, 3: 0.1555, 4: 0.1498, 5: 0.2108, 17: 0.1785, 18: 0.149, 19: 0.16,
                20: 0.1996, 48: 0.2331}
    fitted = cost(0.03, measured).monotone_verify()
    values = [fitted[rows] for rows in sorted(fitted)]
    assert sorted(fitted) == sorted(measured) and values == sorted(values)
    assert fitted[1] == 0.1555 and fitted[2] == fitted[4] == pytest.approx((0.1691 + 0.1555 + 0.1498) / 3)
    assert fitted[5] == fitted[19] == pytest.approx((0.2108 + 0.1785 + 0.149 + 0.16) / 4)
    assert fitted[20] == 0.1996 and fitted[48] == 0.2331  # already in order: kept
    assert cost(0.03, measured).verify_time(10) == pytest.approx(fitted[5])


def test_the_fit_weighs_each_row_count_by_its_samples() -> None:
    c = CostModel()
    for _ in range(20):  # many samples at 2 rows (their weight capped at FIT_WEIGHT), one noisy one at 3
        c.observe_verify(2, 0.30)
    c.observe_verify(3, 0.21)
    fitted = c.monotone_verify()
    assert fitted[2] == fitted[3] == pytest.approx((FIT_WEIGHT * 0.30 + 0.21) / (FIT_WEIGHT + 1))
    c.observe_verify(4, 0.40)  # a new sample refits
    assert c.verify_time(4) == 0.40 and c.verify_time(3) == fitted[3]


def test_a_prompts_first_round_speculates_on_its_neighbours_costs() -> None:
    """A new request's first round scores its whole prompt, a row count the engine may never have timed: its cost
    is read off the measured ones, and the round drafts (it used to decode plainly, one token for a prefill)."""
    own = stats_with([3], proposed=3, rounds=20)
    k, reason = choose(own, cost(0.03, {1: 0.15, 2: 0.15, 4: 0.16, 48: 0.23, 128: 0.40}), catch_up=57)
    assert k >= 2 and reason == "cost model"
