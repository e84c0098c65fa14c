"""Extra Ray nodes for the node-loss scenarios: raylets joined to the run's head, each lost and re-added at will.

`specserve chaos run` runs inside scripts/in-netns.sh (one loopback-only network namespace) and starts its head
itself (`ray.init` in chaos/cluster.py). The multi-node test cluster (tests/cluster/multinode/netns_cluster.py) puts
each node in a network namespace of its own with its own address, but its head is a `ray start --head` in a
namespace of its own too; here the head is this process's, on 127.0.0.1, so the extra nodes are raylets on the same
loopback instead (as that harness's LoopbackNode fallback, and ray.cluster_utils.Cluster, run them): each is a Ray
node of its own (`ray start --address`, its own temp folder, its own custom resources, so `ClusterConfig.placement`
puts one part on it), but they share one address.

A node is lost by SIGKILL of every one of its processes at once (its raylet and every worker it started, found by
NODE_MARK in their environment, which the raylet's children inherit: all started here), and re-added by `ray start`
again (a new raylet, a new node id, the same resources). `stop()` ends exactly what was started here; never
`ray stop`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

NODE_MARK = "SPECSERVE_CHAOS_NODE"  # in every process of an extra node: its temp folder
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # per node: nothing large crosses the object store here
RAY = str(Path(sys.executable).parent / "ray")


@dataclass(frozen=True)
class NodeSpec:
    """One extra node: its name (also its temp folder's), logical CPUs and custom resources."""

    name: str
    resources: Mapping[str, float] = field(default_factory=dict)
    num_cpus: int = 1

    @staticmethod
    def of(fields: Mapping[str, object]) -> NodeSpec:
        """From an experiment's `nodes` entry: {"name": ..., "resources": {...}, "num_cpus": ...}."""
        return NodeSpec(str(fields["name"]), dict(fields.get("resources", {})),  # type: ignore[call-overload]
                        int(fields.get("num_cpus", 1)))  # type: ignore[call-overload]


def marked_pids(mark: bytes) -> list[int]:
    """Every process whose environment holds `mark` (NAME=VALUE), but this one."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if mark in environ.split(b"\0"):
            found.append(int(entry))
    return found


class ExtraNodes:
    """The extra nodes of one run, joined to the head at `gcs_address`. Owner: the runner's thread (the actions
    that lose and re-add a node run on it, between the load's own threads)."""

    def __init__(self, root: Path, gcs_address: str, specs: Sequence[NodeSpec]) -> None:
        self.root = root
        self.gcs_address = gcs_address
        self.specs = {spec.name: spec for spec in specs}

    def temp_dir(self, name: str) -> Path:
        return self.root / name

    def _mark(self, name: str) -> bytes:
        return f"{NODE_MARK}={self.temp_dir(name)}".encode()

    def start(self, timeout_s: float = 180.0) -> None:
        import ray

        before = sum(1 for n in ray.nodes() if n["Alive"])
        for name in self.specs:
            self.add(name)
        self.wait_alive(before + len(self.specs), timeout_s)

    def add(self, name: str) -> None:
        """`ray start --address` for the node (its first start, or a re-added node after a loss)."""
        spec = self.specs[name]
        folder = self.temp_dir(name)
        folder.mkdir(parents=True, exist_ok=True)
        argv = [RAY, "start", "--address", self.gcs_address, "--node-ip-address", "127.0.0.1",
                "--num-cpus", str(spec.num_cpus), "--object-store-memory", str(OBJECT_STORE_BYTES),
                "--temp-dir", str(folder), "--disable-usage-stats"]
        if spec.resources:
            argv += ["--resources", json.dumps(dict(spec.resources))]
        env = dict(os.environ) | {NODE_MARK: str(folder), "RAY_worker_niceness": "0",
                                  "RAY_raylet_start_wait_time_s": "180"}  # a loaded 2-vCPU machine is slow
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        with (folder / "ray-start.log").open("a") as log:
            log.write(result.stdout + result.stderr)
        if result.returncode != 0:
            raise RuntimeError(f"ray start of node {name} failed ({result.returncode}): "
                               f"{(result.stdout + result.stderr)[-2000:]}")

    def lose(self, name: str) -> list[int]:
        """Every process of the node killed at once (SIGKILL): its raylet and workers. Returns their ids."""
        pids = marked_pids(self._mark(name))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def wait_alive(self, count: int, timeout_s: float) -> None:
        import ray

        deadline = time.monotonic() + timeout_s
        while (alive := sum(1 for n in ray.nodes() if n["Alive"])) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{alive} of {count} Ray nodes alive after {timeout_s:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """End every process of every extra node: SIGTERM, then SIGKILL what is left."""
        marks = [self._mark(name) for name in self.specs]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for mark in marks:
                for pid in marked_pids(mark):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + 10
            while sig == signal.SIGTERM and any(marked_pids(m) for m in marks) and time.monotonic() < deadline:
                time.sleep(0.2)
