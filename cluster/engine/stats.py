"""Engine-wide timing figures derived from the engine's running totals."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.round_plan import RoundPlan
from cluster.engine.spec_policy import CostModel


def busy_fractions(totals: Mapping[str, float]) -> dict[str, float]:
    """Busy fractions of drafter and verifier over the engine's active round time, and the overlap
    achieved: the share of the shorter busy time that ran concurrently with the other.

        overlap = max(0, t_draft + t_verify - t_rounds) / min(t_draft, t_verify)
    """
    wall = totals.get("round_seconds", 0.0)
    draft, verify = totals.get("draft_seconds", 0.0), totals.get("verify_seconds", 0.0)
    if wall <= 0:
        return {"drafter_busy_fraction": 0.0, "verifier_busy_fraction": 0.0, "overlap_fraction": 0.0}
    shorter = min(draft, verify)
    overlap = max(0.0, draft + verify - wall) / shorter if shorter > 0 else 0.0
    return {"drafter_busy_fraction": min(1.0, draft / wall), "verifier_busy_fraction": min(1.0, verify / wall),
            "overlap_fraction": min(1.0, overlap)}


def add_round_times(totals: dict[str, float], plans: Sequence[RoundPlan], draft_seconds: float,
                    verify_seconds: float, reconcile_seconds: float, round_seconds: float) -> None:
    """One round's time split, on each of its requests and in the engine's totals."""
    for plan in plans:
        plan.state.draft_seconds += draft_seconds
        plan.state.verify_seconds += verify_seconds
        plan.state.reconcile_seconds += reconcile_seconds
    totals["rounds"] += 1
    totals["draft_seconds"] += draft_seconds
    totals["verify_seconds"] += verify_seconds
    totals["reconcile_seconds"] += reconcile_seconds
    totals["round_seconds"] += round_seconds


def engine_stats(identity: Mapping[str, Any], totals: Mapping[str, float], acceptance: AcceptanceStats,
                 cost: CostModel, fallback_events: Sequence[dict[str, Any]], kv_free_fraction: float,
                 overlap: Mapping[str, Any], lookup: AcceptanceStats | None = None) -> dict[str, Any]:
    """`SpecEngine.stats()` as one JSON-able dict (GetStats, `--json`, benchmarks); `identity` holds
    model, draft, running and waiting; `overlap` whether the drafter runs beside the verifier, how, why
    (overlap_policy.py) and the pre-draft counts (predraft.py). `acceptance` counts every draft: the drafter's
    (`acceptance`) and model-drafted requests' n-gram lookups (`lookup`, also apart as `lookup_acceptance`)."""
    looked = lookup is not None and lookup.rounds > 0
    return {
        **identity,
        "rounds": int(totals.get("rounds", 0)),
        "acceptance": (acceptance if lookup is None else acceptance.merge(lookup)).to_dict(),
        **({"lookup_acceptance": lookup.to_dict()} if looked else {}),
        "draft_seconds": totals.get("draft_seconds", 0.0),
        "verify_seconds": totals.get("verify_seconds", 0.0),
        "reconcile_seconds": totals.get("reconcile_seconds", 0.0),
        "round_seconds": totals.get("round_seconds", 0.0),
        "verify_call_seconds": totals.get("verify_call_seconds", 0.0),  # verify + the hop to it
        "kv_seconds": totals.get("kv_seconds", 0.0),  # the round's reserve and commit calls (on its path)
        # of which: waited for the ledger call beside the verify, after the verify answered (held_commit.py)
        "kv_ahead_wait_seconds": totals.get("kv_ahead_wait_seconds", 0.0),
        # greedy draft-model chains of auto that could end at an unsure draft (draft_stop_below), and those that did;
        # the same for trees (stopped: fewer levels than k)
        **{f"draft_{kind}": {"may_stop": int(totals.get(f"draft_{kind}_may_stop", 0)),
                             "stopped": int(totals.get(f"draft_{kind}_stopped", 0))} for kind in ("chains", "trees")},
        # drafts requests' constraints forced (planner.py), apart from `acceptance`
        "forced": {"proposed": int(totals.get("forced_proposed", 0)), "accepted": int(totals.get("forced_accepted", 0))},
        "constraint_cut": int(totals.get("constraint_cut", 0)),  # drafts a constraint forbade (cut before the verify)
        "cost_model": {"draft_token_seconds": cost.draft_token, "draft_tree_level_seconds": cost.draft_tree_level,
                       "draft_catch_up_row_seconds": cost.draft_catch_up_row,
                       "verify_seconds_by_tokens": dict(cost.verify_by_tokens)},
        **busy_fractions(totals),
        "overlap": dict(overlap),
        "fallback_events": list(fallback_events),
        "kv_free_fraction": kv_free_fraction,
    }
