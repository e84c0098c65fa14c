"""`bench spec`'s sums per config (or transformers / llama.cpp mode) and the ratios between two of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.engine.acceptance_stats import AcceptanceStats


@dataclass
class Tally:
    """Sums over the runs of one config (or one transformers mode)."""

    output_tokens: int = 0
    wall_seconds: float = 0.0
    by_category: dict[str, list[float]] = field(default_factory=dict)  # category -> [tokens, seconds]
    acceptance: AcceptanceStats = field(default_factory=AcceptanceStats)
    acceptance_by_category: dict[str, AcceptanceStats] = field(default_factory=dict)
    split: dict[str, float] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # prompt id -> output token ids
    loadavg: list[float] = field(default_factory=list)
    policy_reasons: dict[str, int] = field(default_factory=dict)  # why k was chosen, per request change
    # greedy draft-model chains and trees that could stop at an unsure draft, and those that did (engine stats)
    draft_stops: dict[str, dict[str, int]] = field(default_factory=dict)

    def add_stops(self, stats: dict[str, Any]) -> None:
        for kind in ("chains", "trees"):
            cell = self.draft_stops.setdefault(kind, {"may_stop": 0, "stopped": 0})
            for key in cell:
                cell[key] += int(stats.get(f"draft_{kind}", {}).get(key, 0))

    def add(self, category: str | None, tokens: int, seconds: float) -> None:
        self.output_tokens += tokens
        self.wall_seconds += seconds
        if category is not None:
            cell = self.by_category.setdefault(category, [0, 0.0])
            cell[0] += tokens
            cell[1] += seconds

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "output_tokens": self.output_tokens, "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.output_tokens / self.wall_seconds if self.wall_seconds else 0.0,
            "by_category": {c: {"output_tokens": int(t), "wall_seconds": s, "tokens_per_second": t / s if s else 0.0}
                            for c, (t, s) in self.by_category.items()},
            "mean_loadavg_1min": sum(self.loadavg) / len(self.loadavg) if self.loadavg else None,
        }
        if self.policy_reasons:
            out["policy_reasons"] = dict(self.policy_reasons)
        if any(cell["may_stop"] for cell in self.draft_stops.values()):
            out["draft_stops"] = {kind: dict(cell) for kind, cell in self.draft_stops.items()}
        if self.acceptance.rounds:
            out["acceptance"] = self.acceptance.to_dict()
            for cat, acc in self.acceptance_by_category.items():
                out["by_category"].setdefault(cat, {})["acceptance"] = acc.to_dict()
        if self.split:
            total = self.wall_seconds or 1.0
            out["time_split_seconds"] = dict(self.split)
            out["time_split_fraction"] = {name: s / total for name, s in self.split.items()}
        return out


def acc_rate(stats: dict[str, Any]) -> float:
    return stats["acceptance"]["acceptance_rate"]


def ratio(a: Tally, b: Tally) -> float | None:
    if not (a.wall_seconds and b.wall_seconds and b.output_tokens):
        return None
    return (a.output_tokens / a.wall_seconds) / (b.output_tokens / b.wall_seconds)


def category_ratios(a: Tally, b: Tally) -> dict[str, float]:
    out = {}
    for cat, (tokens, seconds) in a.by_category.items():
        if cat in b.by_category and seconds and b.by_category[cat][0] and b.by_category[cat][1]:
            out[cat] = (tokens / seconds) / (b.by_category[cat][0] / b.by_category[cat][1])
    return out


def same_fraction(a: Tally, b: Tally) -> float | None:
    common = [pid for pid in a.outputs if pid in b.outputs]
    return sum(a.outputs[pid] == b.outputs[pid] for pid in common) / len(common) if common else None
