"""CPU binding (cluster/serving/cpu_binding.py): the plan, who gets one, and the threads that follow it."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from cluster.serving import cpu_quota
from cluster.serving.config import make_config
from cluster.serving.cpu_binding import AUTO_SERVICE_CPUS, CpuPlan, own_cpus, plan_cpus, thread_cpus
from model_runtime.compute_thread import ComputeThread
from tests.cluster.serving.test_cpu_quota import v2_tree

MASK = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(MASK) < 2, reason="needs 2 CPUs in the affinity mask")


def test_compute_takes_the_last_cpus_and_leaves_the_rest_to_everything_else() -> None:
    assert plan_cpus([0, 1], 1) == CpuPlan(service=(0,), ranks=((1,),), drafter=None)
    assert plan_cpus([3, 1, 2, 1], 1) == CpuPlan(service=(1, 2), ranks=((3,),), drafter=None)  # sorted, once each
    plan = plan_cpus(range(8), 2, ranks=2, drafter_threads=2, drafter_beside=True)
    assert plan == CpuPlan(service=(0, 1), ranks=((6, 7), (4, 5)), drafter=(2, 3))
    assert plan is not None and plan.describe() == \
        "verifier rank 0: CPU 6,7; verifier rank 1: CPU 4,5; drafter: CPU 2,3; everything else: CPU 0,1"
    # a drafter that drafts while the verifier waits shares rank 0's CPUs
    assert plan_cpus(range(4), 2, drafter_threads=2) == CpuPlan(service=(0, 1), ranks=((2, 3),), drafter=(2, 3))


def test_a_shared_plan_pins_the_compute_threads_and_gives_the_rest_every_cpu() -> None:
    plan = plan_cpus([0, 1], 1)
    assert plan is not None and not plan.shared
    shared = plan.sharing()
    assert shared == CpuPlan(service=(0, 1), ranks=((1,),), drafter=None, shared=True)
    assert shared.describe() == "verifier rank 0: CPU 1; everything else: CPU 0,1 (shared)"
    beside = plan_cpus(range(4), 1, drafter_threads=1, drafter_beside=True)
    assert beside is not None and beside.sharing().service == (0, 1, 2, 3)
    assert beside.sharing().ranks == beside.ranks and beside.sharing().drafter == beside.drafter


def test_no_plan_when_the_model_threads_need_every_cpu() -> None:
    assert plan_cpus([0, 1], 2) is None
    assert plan_cpus(range(4), 2, ranks=2) is None
    assert plan_cpus(range(4), 1, drafter_threads=2, drafter_beside=True) is not None
    assert plan_cpus(range(4), 2, drafter_threads=2, drafter_beside=True) is None
    with pytest.raises(ValueError, match=">= 1"):
        plan_cpus(range(4), 0)


def test_cpus_under_a_quota_smaller_than_the_mask_are_not_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, proc = v2_tree(tmp_path, {".": f"{len(MASK) * 100000} 100000"})  # a quota as large as the mask
    monkeypatch.setattr(cpu_quota, "CGROUP_ROOT", root)
    monkeypatch.setattr(cpu_quota, "PROC_SELF_CGROUP", proc)
    assert own_cpus() == MASK
    if len(MASK) >= 2:
        tight = tmp_path / "tight"
        tight.mkdir()
        root, proc = v2_tree(tight, {".": f"{(len(MASK) - 1) * 100000} 100000"})  # a pod on a shared node
        monkeypatch.setattr(cpu_quota, "CGROUP_ROOT", root)
        monkeypatch.setattr(cpu_quota, "PROC_SELF_CGROUP", proc)
        assert own_cpus() is None
        assert make_config(model="smollm2-135m", draft="ngram", worker_threads=1, cpu_binding="on").cpu_plan() is None


@needs_two
def test_the_config_plans_only_when_binding_is_on_on_cpu_and_cpus_are_left(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_quota, "CGROUP_ROOT", tmp_path / "absent")  # no quota
    plan = make_config(model="smollm2-135m", draft="ngram", worker_threads=1, cpu_binding="on").cpu_plan()
    assert plan == CpuPlan(service=tuple(MASK[:-1]), ranks=((MASK[-1],),), drafter=None)
    auto = make_config(model="smollm2-135m", draft="ngram", worker_threads=1).cpu_plan()
    # auto leaves two CPUs to the rest, or pins the compute threads alone and shares every CPU with the rest
    assert plan is not None
    assert auto == (plan if len(MASK) - 1 >= AUTO_SERVICE_CPUS else plan.sharing())
    assert make_config(model="smollm2-135m", draft="ngram", worker_threads=1, cpu_binding="off").cpu_plan() is None
    assert make_config(model="smollm2-135m", draft="ngram", worker_threads=1, cpu_binding="on",
                       device="cuda").cpu_plan() is None
    assert make_config(model="smollm2-135m", draft="ngram", cpu_binding="on").cpu_plan() is None  # threads take all


@needs_two
def test_thread_cpus_moves_the_thread_and_what_it_starts_then_restores_it() -> None:
    seen: list[set[int]] = []
    with thread_cpus([MASK[0]]):
        assert os.sched_getaffinity(0) == {MASK[0]}
        child = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        child.start()
        child.join()
    assert seen == [{MASK[0]}]
    assert sorted(os.sched_getaffinity(0)) == MASK
    with thread_cpus(None):
        assert sorted(os.sched_getaffinity(0)) == MASK


@needs_two
def test_a_compute_thread_runs_on_its_cpus_and_ignores_cpus_it_cannot_have(caplog: pytest.LogCaptureFixture) -> None:
    compute = ComputeThread("test-compute", torch_threads=1, cpus=[MASK[-1]])
    try:
        assert compute.cpus == (MASK[-1],)
        assert compute.call(os.sched_getaffinity, 0) == {MASK[-1]}
        assert sorted(os.sched_getaffinity(0)) == MASK  # the caller's mask is its own
    finally:
        compute.close()
    with caplog.at_level(logging.WARNING):
        compute = ComputeThread("test-compute", cpus=[100_000])
    try:
        assert compute.cpus is None and "cannot run on CPUs [100000]" in caplog.text
        assert sorted(compute.call(os.sched_getaffinity, 0)) == MASK
    finally:
        compute.close()
