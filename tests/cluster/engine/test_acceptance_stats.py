"""Tests of AcceptanceStats: per-position survival, histogram, E[Y], merge, dict round trip."""

from __future__ import annotations

import pytest

from cluster.engine.acceptance_stats import AcceptanceStats


def _stats(rounds: list[tuple[int, int]], contract: str = "exact") -> AcceptanceStats:
    stats = AcceptanceStats()
    for accepted_len, proposed in rounds:
        stats.record(accepted_len, proposed, contract)
    return stats


def test_survival_is_measured_per_position_not_assumed_iid() -> None:
    """Position 1 always survives, position 2 never: s = [1, 0, 0], whatever the overall acceptance rate (1/3)."""
    stats = _stats([(1, 3)] * 4)
    assert stats.survival() == [1.0, 0.0, 0.0]
    assert stats.acceptance_rate == pytest.approx(1 / 3)
    assert stats.expected_tokens_per_round(3) == 2.0  # an i.i.d. model would say 1 + 1/3 + 1/9 + 1/27
    assert stats.mean_tokens_per_round == 2.0


def test_ragged_rounds() -> None:
    #            accepted_len, proposed
    rounds = [(0, 2), (2, 2), (1, 4), (4, 4), (0, 0)]
    stats = _stats(rounds)
    assert (stats.rounds, stats.proposed, stats.accepted) == (5, 12, 7)
    assert stats.accepted_len_histogram == [2, 1, 1, 0, 1]
    assert stats.reached == [4, 4, 2, 2]  # the k = 0 round reaches no draft position
    assert stats.survived == [3, 2, 1, 1]
    assert stats.survival() == [0.75, 0.5, 0.5, 0.5]
    assert stats.expected_tokens_per_round(2) == 1 + 0.75 + 0.5
    assert stats.expected_tokens_per_round(8) == 1 + 0.75 + 0.5 + 0.5 + 0.5
    assert stats.mean_tokens_per_round == (7 + 5) / 5


def test_merge_equals_recording_everything_in_one() -> None:
    first, second = [(0, 2), (2, 2)], [(1, 4), (4, 4), (0, 0)]
    merged = _stats(first, "exact").merge(_stats(second, "greedy"))
    whole = _stats(first, "exact")
    for accepted_len, proposed in second:
        whole.record(accepted_len, proposed, "greedy")
    assert merged == whole
    assert merged.rounds_by_contract == {"exact": 2, "greedy": 3}
    assert AcceptanceStats().merge(merged) == merged


def test_dict_round_trip_and_empty_stats() -> None:
    stats = _stats([(1, 2), (0, 3)], "typical")
    data = stats.to_dict()
    assert data["survival"] == [0.5, 0.0, 0.0] and data["mean_tokens_per_round"] == 1.5
    assert AcceptanceStats.from_dict(data) == stats
    empty = AcceptanceStats()
    assert empty.mean_tokens_per_round == 0.0 and empty.acceptance_rate == 0.0 and empty.survival() == []
    with pytest.raises(AssertionError):
        empty.record(3, 2, "exact")
