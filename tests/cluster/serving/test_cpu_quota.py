"""cluster/serving/cpu_quota.py over fake cgroup trees in tmp_path (v2, v1, nested, hidden paths, garbage)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.serving import cpu_quota
from cluster.serving.config import make_config
from cluster.serving.cpu_quota import available_cpus, cgroup_cpu_limit

POD = "kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope"


def v2_tree(tmp_path: Path, limits: dict[str, str], own: str = "/") -> tuple[Path, Path]:
    """A cgroup v2 mount at tmp_path/cg with `cpu.max` per relative directory; /proc/self/cgroup says `own`."""
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for directory, cpu_max in limits.items():
        (root / directory).mkdir(parents=True, exist_ok=True)
        (root / directory / "cpu.max").write_text(cpu_max + "\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"0::{own}\n")
    return root, proc


def v1_tree(tmp_path: Path, mount: str, limits: dict[str, tuple[str, str]], own: str = "/") -> tuple[Path, Path]:
    """A cgroup v1 layout: the cpu controller mounted at tmp_path/cg/<mount>, quota/period per directory."""
    root = tmp_path / "cg"
    (root / "memory").mkdir(parents=True)
    for directory, (quota, period) in limits.items():
        target = root / mount / directory
        target.mkdir(parents=True, exist_ok=True)
        (target / "cpu.cfs_quota_us").write_text(quota + "\n")
        (target / "cpu.cfs_period_us").write_text(period + "\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"12:memory:{own}\n4:{mount}:{own}\n1:name=systemd:{own}\n")
    return root, proc


@pytest.mark.parametrize(("cpu_max", "cpus"), [
    ("800000 100000", 8.0),  # limits.cpu: 8
    ("50000 100000", 0.5),  # limits.cpu: 500m
    ("250000 100000", 2.5),
    ("max 100000", None),  # no limit
])
def test_v2_cpu_max_in_a_cgroup_namespace(tmp_path: Path, cpu_max: str, cpus: float | None) -> None:
    root, proc = v2_tree(tmp_path, {".": cpu_max})
    assert cgroup_cpu_limit(root, proc) == cpus


def test_v2_smallest_limit_on_the_path_wins(tmp_path: Path) -> None:
    """Without a cgroup namespace the process's path is below the mount: the pod's limit binds the container."""
    pod = POD.rsplit("/", 1)[0]
    root, proc = v2_tree(tmp_path, {pod: "400000 100000", POD: "max 100000", "kubepods.slice": "9600000 100000"},
                         own=f"/{POD}")
    assert cgroup_cpu_limit(root, proc) == 4.0


def test_v2_path_hidden_by_the_mount_reads_its_root(tmp_path: Path) -> None:
    """/proc/self/cgroup names a path the container's mount does not show: the mount's root is the container."""
    root, proc = v2_tree(tmp_path, {".": "300000 100000"}, own=f"/{POD}")
    assert cgroup_cpu_limit(root, proc) == 3.0


@pytest.mark.parametrize("garbage", ["", "max", "abc 100000", "100000 0", "-1 100000", "1 2 3"])
def test_v2_unreadable_cpu_max_is_no_limit(tmp_path: Path, garbage: str) -> None:
    root, proc = v2_tree(tmp_path, {".": garbage})
    assert cgroup_cpu_limit(root, proc) is None


@pytest.mark.parametrize("mount", ["cpu,cpuacct", "cpu"])
def test_v1_cfs_quota(tmp_path: Path, mount: str) -> None:
    root, proc = v1_tree(tmp_path, mount, {".": ("600000", "100000")})
    assert cgroup_cpu_limit(root, proc) == 6.0


def test_v1_no_quota_and_nested_quota(tmp_path: Path) -> None:
    root, proc = v1_tree(tmp_path, "cpu,cpuacct", {".": ("-1", "100000")})
    assert cgroup_cpu_limit(root, proc) is None
    nested = tmp_path / "nested"
    nested.mkdir()
    root, proc = v1_tree(nested, "cpu,cpuacct", {".": ("-1", "100000"), "kubepods/pod1": ("200000", "100000"),
                                                 "kubepods/pod1/c1": ("-1", "100000")}, own="/kubepods/pod1/c1")
    assert cgroup_cpu_limit(root, proc) == 2.0


def test_no_cgroup_mount_is_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path / "absent", tmp_path / "absent-proc") is None


def test_available_cpus_is_the_quota_rounded_down_within_the_affinity(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    root, proc = v2_tree(tmp_path, {".": f"{affinity * 100000 + 50000} 100000"})  # affinity + 0.5 CPUs
    assert available_cpus(root, proc) == affinity  # the mask caps the quota
    tight = tmp_path / "tight"
    tight.mkdir()
    root, proc = v2_tree(tight, {".": "150000 100000"})  # 1.5 CPUs
    assert available_cpus(root, proc) == 1
    small = tmp_path / "small"
    small.mkdir()
    root, proc = v2_tree(small, {".": "10000 100000"})  # 100m: still one thread
    assert available_cpus(root, proc) == 1
    assert available_cpus(tmp_path / "absent", tmp_path / "absent-proc") == affinity


def test_threads_per_worker_follow_the_quota_unless_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs in the affinity mask to tell a 1-CPU quota from the mask")
    root, proc = v2_tree(tmp_path, {".": "100000 100000"})  # limits.cpu: 1 on a bigger machine
    monkeypatch.setattr(cpu_quota, "CGROUP_ROOT", root)
    monkeypatch.setattr(cpu_quota, "PROC_SELF_CGROUP", proc)
    config = make_config(model="smollm2-135m", draft="ngram", tensor_parallel_size=2)
    assert config.threads_per_worker == 1  # not os.cpu_count() // 2
    assert make_config(model="smollm2-135m", draft="ngram", worker_threads=6).threads_per_worker == 6  # explicit wins
    monkeypatch.setattr(cpu_quota, "CGROUP_ROOT", tmp_path / "absent")
    assert make_config(model="smollm2-135m", draft="ngram").threads_per_worker == len(os.sched_getaffinity(0))
