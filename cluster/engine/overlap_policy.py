"""Overlap policy: whether the drafter runs beside the verifier (docs/ARCHITECTURE.md §2), and why.

Overlap pays only when the drafter and the verifier compute on resources of their own: on shared ones the two
calls take turns on the same cores (or GPU) and the round gets no shorter, only noisier. `overlap: auto` (the
default) decides from where the two run:

    where                                   decision
    in process (generate, bench spec)       off: one process, one device (its CPUs or its GPU) for both
    no draft model (n-gram, or none)        off: n-gram drafts are made on the engine thread, nothing to overlap
    CUDA, gpus_per_worker = 1               on:  Ray gives the drafter and every verifier rank a GPU of its own
    CUDA, gpus_per_worker < 1               off: Ray may pack the drafter onto a verifier rank's GPU
    CPU, worker_threads = 0                 off: every model process sizes its threads to all the CPUs
    CPU, worker_threads = t                 on iff (TP ranks + drafter) * t + 1 <= CPUs: each model process gets
                                            cores no other one needs, with one CPU left for the scheduler (engine
                                            thread, Serve calls) and the ingress; e.g. 2 CPUs, t = 1: 3 > 2, off

`overlap: true` / `false` force it; the reason then says so and what auto would have decided. Pure: the caller
(`ClusterConfig.overlap_decision`) passes the facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

OverlapSetting = Literal["auto"] | bool


@dataclass(frozen=True)
class Placement:
    """Where the drafter and the verifier run, as far as overlap cares."""

    in_process: bool  # one process runs both (specserve generate, bench spec, check exact)
    draft_model: bool  # a Drafter exists (draft is a model, not 'ngram')
    device: str  # 'cpu' or 'cuda...'
    gpus_per_worker: float  # CUDA: GPUs per drafter replica and per verifier rank
    tensor_parallel_size: int  # verifier ranks
    worker_threads: int  # torch threads per model process (0: sized to every CPU)
    cpus: int  # CPUs this process may use (affinity capped by the cgroup quota)


@dataclass(frozen=True)
class OverlapDecision:
    enabled: bool
    reason: str


def auto_overlap(p: Placement) -> OverlapDecision:
    """What `overlap: auto` decides for `p`, with the reason."""
    cuda = p.device.startswith("cuda")
    if not p.draft_model:
        return OverlapDecision(False, "no draft model: n-gram drafts are made on the engine thread")
    if p.in_process:
        shared = p.device if cuda else f"its {p.cpus} CPU{'s' if p.cpus != 1 else ''}"
        return OverlapDecision(False, f"in process: the drafter and the verifier share this process and {shared}")
    if cuda:
        if p.gpus_per_worker >= 1:
            return OverlapDecision(True, "the drafter and each verifier rank have a GPU of their own")
        return OverlapDecision(False, f"gpus_per_worker {p.gpus_per_worker:g}: Ray may place the drafter on a "
                                      "verifier rank's GPU")
    processes = p.tensor_parallel_size + 1
    if p.worker_threads == 0:
        return OverlapDecision(False, f"worker_threads 0: each of the {processes} model processes sizes its "
                                      f"threads to all {p.cpus} CPUs, so the drafter and the verifier share them")
    needed = processes * p.worker_threads + 1
    split = (f"{p.tensor_parallel_size} verifier rank{'s' if p.tensor_parallel_size > 1 else ''} + the drafter "
             f"at {p.worker_threads} thread{'s' if p.worker_threads > 1 else ''} each, + 1 CPU for the scheduler")
    if needed <= p.cpus:
        return OverlapDecision(True, f"{split} fit in {p.cpus} CPUs: no core is shared")
    return OverlapDecision(False, f"{split} need {needed} CPUs, {p.cpus} available: the drafter and the "
                                  "verifier would share cores")


def decide_overlap(setting: OverlapSetting, p: Placement) -> OverlapDecision:
    """The configured setting applied: auto follows `auto_overlap`; true/false are obeyed (an engine without a
    drafter still has nothing to overlap: `engine_overlap`)."""
    auto = auto_overlap(p)
    if setting == "auto":
        return OverlapDecision(auto.enabled, f"auto: {auto.reason}")
    forced = bool(setting)
    return OverlapDecision(forced, f"overlap: {str(forced).lower()} in the config (auto would be "
                                   f"{'on' if auto.enabled else 'off'}: {auto.reason})")


def engine_overlap(overlap: bool, reason: str, predraft: bool, has_drafter: bool) -> dict[str, Any]:
    """The engine's overlap as it runs (engine stats `overlap`, logged at start): enabled, mode, reason."""
    enabled = overlap and has_drafter
    if overlap and not has_drafter:
        reason = "no draft model: nothing to overlap"
    mode = None if not enabled else "predraft" if predraft else "two groups"
    summary: dict[str, Any] = {"enabled": enabled, "mode": mode, "reason": reason}
    if predraft and not enabled:
        summary["predraft"] = "off: pre-drafting runs on the draft thread, which only overlap starts"
    return summary


__all__ = ["OverlapDecision", "OverlapSetting", "Placement", "auto_overlap", "decide_overlap", "engine_overlap"]
