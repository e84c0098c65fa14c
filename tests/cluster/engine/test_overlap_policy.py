"""The overlap policy (cluster/engine/overlap_policy.py): on only where the drafter and the verifier have
devices of their own, with the reason; forced settings are obeyed and say what auto would have done."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.engine.overlap_policy import Placement, auto_overlap, decide_overlap, engine_overlap

CLUSTER_CPU = Placement(in_process=False, draft_model=True, device="cpu", gpus_per_worker=1.0,
                        tensor_parallel_size=1, worker_threads=0, cpus=2)


@pytest.mark.parametrize(("changes", "enabled", "words"), [
    ({}, False, "worker_threads 0"),  # every process sizes its threads to all CPUs: shared
    ({"worker_threads": 1}, False, "need 3 CPUs, 2 available"),  # this machine: 2 CPUs, nothing left over
    ({"worker_threads": 1, "cpus": 3}, True, "fit in 3 CPUs"),
    ({"worker_threads": 4, "cpus": 16, "tensor_parallel_size": 2}, True, "fit in 16 CPUs"),  # 3 * 4 + 1
    ({"worker_threads": 4, "cpus": 12, "tensor_parallel_size": 2}, False, "need 13 CPUs"),
    ({"in_process": True}, False, "share this process and its 2 CPUs"),
    ({"in_process": True, "device": "cuda"}, False, "share this process and cuda"),
    ({"device": "cuda"}, True, "a GPU of their own"),
    ({"device": "cuda", "gpus_per_worker": 0.5}, False, "gpus_per_worker 0.5"),
    ({"draft_model": False, "device": "cuda"}, False, "no draft model"),
])
def test_auto(changes: dict, enabled: bool, words: str) -> None:
    decision = auto_overlap(dataclasses.replace(CLUSTER_CPU, **changes))
    assert decision.enabled is enabled and words in decision.reason, decision


def test_forced_settings_are_obeyed_and_say_what_auto_would_do() -> None:
    on = decide_overlap(True, CLUSTER_CPU)
    assert on.enabled and on.reason.startswith("overlap: true in the config (auto would be off: worker_threads 0")
    gpu = dataclasses.replace(CLUSTER_CPU, device="cuda")
    off = decide_overlap(False, gpu)
    assert not off.enabled and "auto would be on" in off.reason
    auto = decide_overlap("auto", gpu)
    assert auto.enabled and auto.reason.startswith("auto: ")


def test_the_engine_reports_what_runs() -> None:
    assert engine_overlap(True, "r", predraft=False, has_drafter=True) == {
        "enabled": True, "mode": "two groups", "reason": "r"}
    assert engine_overlap(True, "r", predraft=True, has_drafter=True)["mode"] == "predraft"
    no_drafter = engine_overlap(True, "r", predraft=False, has_drafter=False)
    assert not no_drafter["enabled"] and "no draft model" in no_drafter["reason"]
    off = engine_overlap(False, "auto: shared", predraft=True, has_drafter=True)
    assert off["mode"] is None and off["predraft"].startswith("off")
