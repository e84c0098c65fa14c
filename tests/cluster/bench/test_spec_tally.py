"""bench spec's per-config sums: the draft model's chains and trees that could stop early, summed over runs."""

from __future__ import annotations

from cluster.bench.spec_tally import Tally


def test_draft_stops_sum_over_runs_and_show_only_where_any_could_stop() -> None:
    tally = Tally()
    tally.add(None, 10, 1.0)
    tally.add_stops({"draft_chains": {"may_stop": 0, "stopped": 0}, "draft_trees": {"may_stop": 0, "stopped": 0}})
    assert "draft_stops" not in tally.summary()
    tally.add_stops({"draft_chains": {"may_stop": 3, "stopped": 1}, "draft_trees": {"may_stop": 4, "stopped": 2}})
    tally.add_stops({"draft_chains": {"may_stop": 2, "stopped": 2}})  # an engine's stats without trees
    assert tally.summary()["draft_stops"] == {"chains": {"may_stop": 5, "stopped": 3},
                                              "trees": {"may_stop": 4, "stopped": 2}}
