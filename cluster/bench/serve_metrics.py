"""Serving latency figures of streamed requests, per token (plain Python; `specserve bench serve`).

Glossary:
  token time   when a token reached the client. A chunk of m tokens arriving at t is m tokens at t
               (speculation emits several tokens per round), so gaps inside a chunk are 0.
  TTFT         time to first token: first token time - send time (prefill, queueing, transport).
  TPOT         time per output token of one request after its first: (last - first) / (n - 1).
  ITL          inter-token latency: every gap between consecutive token times of a request,
               zeros inside chunks included; its percentiles show the burstiness TPOT averages away.
  goodput      requests per second that met the SLO (TTFT <= ttft_s and TPOT <= tpot_s).

        sent         chunk 1 (3 tokens)      chunk 2 (1 token)   chunk 3 (2 tokens)
         |------TTFT------|x x x|---------------|x|---------------|x x|
    ITL gaps:                  0 0      g1          g2               0
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTiming:
    """One streamed request: when it was sent, when each of its tokens arrived, and its output."""

    sent_at: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finished_at: float | None = None
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None  # the engine's per-request statistics (final chunk)

    def add_chunk(self, token_ids: Sequence[int], at: float) -> None:
        self.token_times.extend([at] * len(token_ids))
        self.token_ids.extend(token_ids)

    def finish(self, reason: str | None, at: float, stats: dict[str, Any] | None = None) -> None:
        self.finish_reason, self.finished_at, self.stats = reason, at, stats

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def latency(self) -> float | None:
        """End to end: send to the final chunk."""
        return None if self.finished_at is None else self.finished_at - self.sent_at

    def gaps(self) -> list[float]:
        return [later - earlier for earlier, later in itertools.pairwise(self.token_times)]


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met(self, timing: RequestTiming) -> bool:
        ttft, tpot = timing.ttft, timing.tpot
        return ttft is not None and ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) over already sorted values."""
    assert sorted_values, "percentile of nothing"
    rank = (len(sorted_values) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float] | None:
    """{"mean", "p50", "p90", "p99"}, or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return {"mean": sum(ordered) / len(ordered), **{f"p{q}": percentile(ordered, q) for q in PERCENTILES}}


def summarize(timings: Sequence[RequestTiming], wall_s: float, slo: SLO) -> dict[str, Any]:
    """The figures of one load level: latency distributions, throughput and goodput over `wall_s`."""
    output_tokens = sum(len(t.token_times) for t in timings)
    gaps = [gap for t in timings for gap in t.gaps()]
    met = sum(1 for t in timings if slo.met(t))
    return {
        "requests": len(timings),
        "output_tokens": output_tokens,
        "wall_seconds": wall_s,
        "output_tokens_per_second": output_tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_second": len(timings) / wall_s if wall_s > 0 else 0.0,
        "ttft_seconds": distribution([t.ttft for t in timings if t.ttft is not None]),
        "tpot_seconds": distribution([t.tpot for t in timings if t.tpot is not None]),
        "itl_seconds": distribution(gaps),
        "itl_zero_fraction": sum(1 for gap in gaps if gap == 0.0) / len(gaps) if gaps else 0.0,
        "latency_seconds": distribution([t.latency for t in timings if t.latency is not None]),
        "slo": {"ttft_seconds": slo.ttft_s, "tpot_seconds": slo.tpot_s},
        "slo_attainment": met / len(timings) if timings else 0.0,
        "goodput_requests_per_second": met / wall_s if wall_s > 0 else 0.0,
    }
