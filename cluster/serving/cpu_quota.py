"""The CPUs this process may use: its affinity mask, capped by the cgroup CPU quota (a container's CPU limit).

`os.cpu_count()` counts the machine's cores. In a Kubernetes pod with `limits.cpu: 8` on a 96-core node it says
96, and sizing thread pools by it starts 12 times more busy threads than the quota can run: the kernel throttles
the cgroup each period and every parallel region waits for its slowest, throttled thread. The quota lives in:

  cgroup v2   <cgroup>/cpu.max                 "<quota_us> <period_us>" or "max <period_us>"
  cgroup v1   <cpu mount>/<cgroup>/cpu.cfs_quota_us, cpu.cfs_period_us   (quota -1 = none)

`<cgroup>` is this process's path from /proc/self/cgroup. Inside a cgroup namespace (Kubernetes and Docker with
cgroup v2) that path is "/" and the container's own limits sit at the mount's root; without one it is the full
path, which the mount may or may not expose. Every existing directory from the process's cgroup up to the mount's
root is read and the smallest quota wins (a parent's limit binds its children). No quota anywhere: None.

No Ray, no torch: `ClusterConfig.threads_per_worker` calls this wherever the config is evaluated.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["CGROUP_ROOT", "PROC_SELF_CGROUP", "available_cpus", "cgroup_cpu_limit"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
V1_CPU_MOUNTS = ("cpu,cpuacct", "cpu", "cpuacct,cpu")  # how distributions name the v1 cpu controller's mount


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_quota(directory: Path) -> float | None:
    """CPUs from one cgroup v2 directory's cpu.max; None when absent, unlimited or unreadable."""
    text = _read(directory / "cpu.max")
    if text is None:
        return None
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(directory: Path) -> float | None:
    """CPUs from one cgroup v1 directory's cpu.cfs_quota_us / cpu.cfs_period_us; None when -1 or absent."""
    quota_text, period_text = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if quota_text is None or period_text is None:
        return None
    try:
        quota, period = int(quota_text), int(period_text)
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _own_cgroups(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(the v2 path, the v1 cpu controller's path) of this process, from /proc/self/cgroup lines
    `hierarchy-id:controllers:path` ("0::/path" is v2)."""
    v2 = v1 = None
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _lineage(mount: Path, cgroup_path: str | None) -> list[Path]:
    """The existing directories from `mount/cgroup_path` up to `mount` (just `mount` if the path is hidden)."""
    directories = [mount]
    if cgroup_path:
        current = mount
        for part in (p for p in cgroup_path.split("/") if p and p not in (".", "..")):
            current = current / part
            directories.append(current)
    return [d for d in reversed(directories) if d.is_dir()]


def cgroup_cpu_limit(root: Path | None = None, proc_cgroup: Path | None = None) -> float | None:
    """CPUs the cgroup quota allows this process (e.g. 8.0 for `limits.cpu: 8`, 0.5 for `500m`); None = no
    quota found (cgroups not mounted, or no limit on any level)."""
    root = CGROUP_ROOT if root is None else root
    v2_path, v1_path = _own_cgroups(PROC_SELF_CGROUP if proc_cgroup is None else proc_cgroup)
    quotas: list[float] = []
    if (root / "cgroup.controllers").is_file():  # the unified (v2) hierarchy is mounted at root
        quotas = [q for d in _lineage(root, v2_path) if (q := _v2_quota(d)) is not None]
    else:
        for name in V1_CPU_MOUNTS:
            if (root / name).is_dir():
                quotas = [q for d in _lineage(root / name, v1_path) if (q := _v1_quota(d)) is not None]
                break
    return min(quotas) if quotas else None


def available_cpus(root: Path | None = None, proc_cgroup: Path | None = None) -> int:
    """Whole CPUs for this process's compute threads: the affinity mask's size, capped by the cgroup quota
    rounded down (2.5 CPUs -> 2: a third thread would be throttled in every parallel region), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        cpus = len(os.sched_getaffinity(0))
    else:  # macOS, Windows: no affinity API
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        cpus = min(cpus, math.floor(limit))
    return max(1, cpus)
