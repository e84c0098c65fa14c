"""Engine-wide timing figures derived from the engine's running totals."""

from __future__ import annotations

from collections.abc import Mapping


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
