"""Figures of a chaos scenario: JSON, a markdown table, and a PNG timeline (throughput, errors, faults)."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from chaos.invariants import Verdict
from chaos.load import RequestRecord
from chaos.state import FaultEvent

STEADY_FRACTION = 0.8  # "back to steady": a 3 s rolling mean of tokens/s at this fraction of the pre-fault median
FAILED = ("completed", "cancelled")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)


def _phase_figures(records: list[RequestRecord], start: float, end: float) -> dict[str, Any]:
    times = [(t, len(toks)) for r in records for t, toks in zip(r.chunk_times, r.chunk_tokens, strict=True)
             if start <= t < end]
    ttft = [r.chunk_times[0] - r.start for r in records if r.chunk_times and start <= r.start < end]
    itl = [(b - a) / max(1, len(toks)) for r in records
           for a, b, toks in zip(r.chunk_times, r.chunk_times[1:], r.chunk_tokens[1:], strict=False) if start <= b < end]
    span = max(end - start, 1e-9)
    return {"seconds": round(span, 1), "tokens_per_s": round(sum(n for _, n in times) / span, 2),
            "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p99_ms": _pct(ttft, 0.99),
            "itl_p50_ms": _pct(itl, 0.5), "itl_p99_ms": _pct(itl, 0.99)}


def _throughput_bins(records: list[RequestRecord], t0: float, t1: float, width: float = 1.0) -> list[float]:
    bins = [0.0] * max(1, int((t1 - t0) / width) + 1)
    for r in records:
        for t, toks in zip(r.chunk_times, r.chunk_tokens, strict=True):
            if t0 <= t <= t1:
                bins[int((t - t0) / width)] += len(toks) / width
    return bins


def recovery(records: list[RequestRecord], faults: list[FaultEvent], fallback_times: list[float]) -> dict[str, Any]:
    """Time to detect (the first failed request or engine fallback event after the first fault), time to first
    success (the first request started after the last fault that completed) and time back to steady
    throughput (after the last fault); seconds."""
    if not faults or not records:
        return {"time_to_detect_s": None, "time_to_first_success_s": None, "time_to_steady_s": None}
    first, last = faults[0].at, faults[-1].at
    failures = [r.end for r in records if r.outcome not in FAILED and r.end >= first]
    detect = min([*failures, *(t for t in fallback_times if t >= first)], default=None)
    successes = [r.end for r in records if r.outcome == "completed" and r.start >= last]
    t0 = min(r.start for r in records)
    t1 = max(r.end for r in records)
    bins = _throughput_bins(records, t0, t1)
    before = bins[1:int(first - t0)]  # the first second is the ramp-up
    steady = statistics.median(before) if before else None
    back = None
    if steady:
        start_bin = int(last - t0)
        for i in range(start_bin, len(bins) - 2):
            if sum(bins[i:i + 3]) / 3 >= STEADY_FRACTION * steady:
                back = max(0.0, t0 + i - last)
                break
    return {"time_to_detect_s": None if detect is None else round(detect - first, 2),
            "time_to_first_success_s": round(min(successes) - last, 2) if successes else None,
            "time_to_steady_s": None if back is None else round(back, 2),
            "steady_tokens_per_s": None if steady is None else round(steady, 2)}


def scenario_figures(name: str, verdict: Verdict, records: list[RequestRecord], faults: list[FaultEvent],
                     fallback_times: list[float], acceptance: dict[str, Any]) -> dict[str, Any]:
    figures: dict[str, Any] = {"scenario": name, "faults": len(faults), **asdict(verdict), "ok": verdict.ok}
    if records:
        t0, t1 = min(r.start for r in records), max(r.end for r in records)
        rec = recovery(records, faults, fallback_times)
        first = faults[0].at if faults else t1
        steady_at = faults[-1].at + (rec["time_to_steady_s"] or 5.0) if faults else t1
        figures |= rec
        figures["phases"] = {"before": _phase_figures(records, t0, first),
                             "during": _phase_figures(records, first, min(steady_at, t1)),
                             "after": _phase_figures(records, min(steady_at, t1), t1 + 1e-6)}
    figures["acceptance"] = acceptance
    return figures


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "0"
    return str(value)


def markdown(all_figures: list[dict[str, Any]]) -> str:
    head = ("| scenario | faults | sent | completed exact | cancelled | typed errors | lost | diverged | dup. tokens "
            "| detect s | first success s | steady s | tok/s before/during/after | TTFT p50/p99 ms before/during/after "
            "| ITL p50/p99 ms before/during/after | acceptance after / baseline same requests | leaked blocks |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for f in all_figures:
        phases = f.get("phases", {})

        def trio(key: str, phases: dict[str, Any] = phases) -> str:
            return " / ".join(_fmt(phases.get(p, {}).get(key)) for p in ("before", "during", "after"))

        acc = f.get("acceptance", {})
        lines.append(
            f"| {f['scenario']} | {f['faults']} | {f['sent']} | {f['completed_exact']} | {f['cancelled']} "
            f"| {_fmt(f['typed_errors'])} | {f['lost']} | {f['diverged']} | {f['duplicated']} "
            f"| {_fmt(f.get('time_to_detect_s'))} | {_fmt(f.get('time_to_first_success_s'))} "
            f"| {_fmt(f.get('time_to_steady_s'))} | {trio('tokens_per_s')} "
            f"| {trio('ttft_p50_ms')} ; {trio('ttft_p99_ms')} | {trio('itl_p50_ms')} ; {trio('itl_p99_ms')} "
            f"| {_fmt(acc.get('after'))} / {_fmt(acc.get('baseline_same_mix'))} | {f['leaked_blocks']} |")
    return "\n".join(lines) + "\n"


def timeline_png(path: Path, runs: list[tuple[str, list[RequestRecord], list[FaultEvent]]]) -> None:
    """One panel per scenario: tokens/s (1 s bins) and failed requests, faults as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r[1]]
    if not runs:
        return
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.2 * len(runs)), squeeze=False)
    for ax, (name, records, faults) in zip(axes[:, 0], runs, strict=True):
        t0, t1 = min(r.start for r in records), max(r.end for r in records)
        bins = _throughput_bins(records, t0, t1)
        ax.plot(range(len(bins)), bins, color="tab:blue", lw=1.2, label="tokens/s")
        ax.set_ylabel("tok/s")
        ax.set_title(name, fontsize=9, loc="left")
        errors = [r.end - t0 for r in records if r.outcome not in FAILED]
        cancels = [r.end - t0 for r in records if r.outcome == "cancelled"]
        top = max(bins) if bins else 1
        if errors:
            ax.scatter(errors, [top * 0.95] * len(errors), marker="x", color="tab:red", s=14, label="typed error")
        if cancels:
            ax.scatter(cancels, [top * 0.85] * len(cancels), marker="|", color="tab:gray", s=14, label="cancelled")
        for i, fault in enumerate(faults):
            ax.axvline(fault.at - t0, color="tab:orange", lw=0.8, ls="--", label="fault" if i == 0 else None)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since the scenario's load started")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
