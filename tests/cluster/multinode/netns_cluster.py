"""Several Ray nodes on one machine, each in a network namespace of its own with its own address.

Inside the user + network namespace that scripts/in-netns.sh makes (`unshare -rn`: root there, so it may create
interfaces), this module builds:

    this namespace ("the client host")   bridge ssmn0, 10.77.0.1/24: the test talks to the nodes from here
      ├─ veth ─ node 1 (own netns)        eth0 10.77.0.11/24   `ray start --head`
      ├─ veth ─ node 2 (own netns)        eth0 10.77.0.12/24   `ray start --address 10.77.0.11:6379`
      └─ ...

Each node's namespace is held by a `sleep` started under `unshare -n`; its processes are started into it with
`nsenter -t HOLDER -n` (the raylet and everything it starts stay in it). Nothing leaves the outer namespace: it has
no route out, only the bridge and loopback. Ray's token authentication is on (RAY_AUTH_MODE=token, a token file
made here, 0600). A node's processes are found by their network namespace (/proc/PID/ns/net): all of them are
this module's, so `kill_node` (a node lost) and `stop` end exactly what was started here, never anything else
(no `ray stop`).

`refusal()` says why a machine cannot build this (no user namespaces, no veth); there the same cluster runs as
several raylets on loopback (`NetnsCluster(..., isolated=False)`, LoopbackNode): one address for every node, so
the checks of the nodes' own addresses and links skip.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chaos.nodes import marked_pids

SUBNET = "10.77.0"
BRIDGE = "ssmn0"
CLIENT_ADDRESS = f"{SUBNET}.1"  # the outer namespace, on the bridge
GCS_PORT = 6379
VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # per node: nothing large crosses the object store here
NODE_MARK = "SPECSERVE_MULTINODE_NODE"  # in every node process's environment: the node's temp folder


@dataclass(frozen=True)
class NodeSpec:
    """One Ray node: its name (also its temp folder's), logical CPUs, custom resources and labels."""

    name: str
    num_cpus: int = 1
    resources: Mapping[str, float] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)


def _run(argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=True, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]


def refusal() -> str | None:
    """None where nested network namespaces joined by veth pairs through a bridge can be built here; else why
    not (the test then skips or falls back to several raylets on loopback)."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if os.geteuid() != 0:
        return "not root in a user namespace: run under scripts/in-netns.sh (unshare -rn)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    probe = "ssmnprobe"
    try:
        _run(["ip", "link", "add", probe, "type", "veth", "peer", "name", probe + "p"])
        _run(["ip", "link", "delete", probe])
        _run(["ip", "link", "add", probe, "type", "bridge"])
        _run(["ip", "link", "delete", probe])
        _run(["unshare", "-n", "true"])
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        return f"cannot build namespaces here: {detail}"
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _netns_inode(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


class Node:
    """A node's namespace (held by a sleeping process) and what runs in it."""

    def __init__(self, spec: NodeSpec, index: int, root: Path) -> None:
        self.spec = spec
        self.address = f"{SUBNET}.{10 + index}"
        self.temp_dir = root / spec.name
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.host_if = f"ssmnh{index}"
        self.holder = subprocess.Popen(["unshare", "-n", "sleep", "infinity"], start_new_session=True)
        deadline = time.monotonic() + 5
        own = _netns_inode(os.getpid())
        while (netns := _netns_inode(self.holder.pid)) in (None, own):  # unshare has not switched yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"{spec.name}: the namespace holder did not start")
            time.sleep(0.01)
        self.netns = netns
        _run(["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", f"ssmnp{index}"])
        _run(["ip", "link", "set", f"ssmnp{index}", "netns", str(self.holder.pid)])
        _run(["ip", "link", "set", self.host_if, "master", BRIDGE])
        _run(["ip", "link", "set", self.host_if, "up"])
        self.sh(f"ip link set lo up && ip link set ssmnp{index} name eth0 && "
                f"ip addr add {self.address}/24 dev eth0 && ip link set eth0 up")

    def nsenter(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-n", "--", *argv]

    def sh(self, script: str) -> str:
        return _run(self.nsenter(["sh", "-c", script])).stdout

    def popen(self, argv: Sequence[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
        """A process of this node (its own process group), output to `log`."""
        with log.open("ab") as out:
            return subprocess.Popen(self.nsenter(argv), env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def pids(self) -> list[int]:
        """Every process in this node's namespace but its holder: all started here."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.holder.pid and _netns_inode(int(entry)) == self.netns:
                found.append(int(entry))
        return found

    def kill(self, sig: int = signal.SIGKILL) -> list[int]:
        """Signal every process of the node at once (a node lost: its raylet and workers); returns their ids."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def processes(self) -> list[str]:
        """`pid command` of each process in the namespace (for logs)."""
        lines = []
        for pid in self.pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            lines.append(f"{pid} {cmd[:120]}")
        return lines


class LoopbackNode(Node):
    """The fallback where namespaces are refused: a raylet on 127.0.0.1 beside the others (several raylets on
    loopback, as ray.cluster_utils.Cluster runs them). Its processes are found by a variable in their environment
    (NODE_MARK, inherited by the raylet's workers), all started here."""

    def __init__(self, spec: NodeSpec, index: int, root: Path) -> None:  # noqa: D107 - no namespace to build
        self.spec = spec
        self.address = "127.0.0.1"
        self.temp_dir = root / spec.name
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.mark = f"{NODE_MARK}={self.temp_dir}".encode()
        self.holder = None  # type: ignore[assignment]
        self.netns = None  # type: ignore[assignment]

    def nsenter(self, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def pids(self) -> list[int]:
        return marked_pids(self.mark)


class NetnsCluster:
    """`nodes[0]` is the head. `start()` brings every node up (token auth on); `stop()` ends all of it."""

    def __init__(self, root: Path, specs: Sequence[NodeSpec], isolated: bool = True) -> None:
        self.root = root
        self.specs = list(specs)
        self.isolated = isolated  # False: the loopback fallback (LoopbackNode), one address for every node
        self.gcs_port = GCS_PORT if isolated else _free_port()  # loopback may be shared with another Ray
        self.nodes: list[Node] = []
        self.token_file = root / "ray_auth_token"
        self.logs = root / "logs"
        self.drivers: list[subprocess.Popen[bytes]] = []

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def gcs_address(self) -> str:
        return f"{self.head.address}:{self.gcs_port}"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.spec.name == name)

    def env(self, node: Node | None = None, **extra: str) -> dict[str, str]:
        """The environment of a Ray process here: token auth on with this cluster's token file."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_file),
                "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0",
                # a loaded 2-vCPU machine: a raylet may take more than Ray's 60 s to register with the GCS
                "RAY_raylet_start_wait_time_s": "180",
                "RAY_TMPDIR": str(node.temp_dir if node is not None else self.root)}
        if node is not None:
            env[NODE_MARK] = str(node.temp_dir)
        return env | extra

    def start(self, timeout_s: float = 120.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        if self.isolated:
            _run(["ip", "link", "set", "lo", "up"])
            _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
            _run(["ip", "addr", "add", f"{CLIENT_ADDRESS}/24", "dev", BRIDGE])
            _run(["ip", "link", "set", BRIDGE, "up"])
        for index, spec in enumerate(self.specs, start=1):
            self.nodes.append((Node if self.isolated else LoopbackNode)(spec, index, self.root))
        for node in self.nodes:
            try:
                self._ray_start(node, head=node is self.head)
            except RuntimeError:
                if node is self.head:
                    raise
                node.kill()  # what the failed start left, then once more
                self._ray_start(node, head=False)
        self.wait_nodes(len(self.nodes), timeout_s)

    def _ray_start(self, node: Node, head: bool) -> None:
        argv = [RAY, "start", "--node-ip-address", node.address, "--num-cpus", str(node.spec.num_cpus),
                "--object-store-memory", str(OBJECT_STORE_BYTES), "--temp-dir", str(node.temp_dir),
                "--disable-usage-stats"]
        if node.spec.resources:
            argv += ["--resources", json.dumps(dict(node.spec.resources))]
        if node.spec.labels:
            argv += ["--labels", ",".join(f"{k}={v}" for k, v in node.spec.labels.items())]
        argv += (["--head", "--port", str(self.gcs_port), "--include-dashboard", "false"] if head
                 else ["--address", self.gcs_address])
        result = subprocess.run(node.nsenter(argv), env=self.env(node), capture_output=True, text=True, timeout=300)
        with (self.logs / f"ray-start-{node.spec.name}.log").open("a") as log:
            log.write(result.stdout + result.stderr)
        if result.returncode != 0:
            raise RuntimeError(f"ray start on {node.spec.name} failed ({result.returncode}): "
                               f"{(result.stdout + result.stderr)[-2000:]}")

    def restart_node(self, name: str) -> None:
        """`ray start` again in a node whose processes were killed (a node coming back)."""
        self._ray_start(self.node(name), head=False)

    def python(self, code: str, node: Node | None = None, timeout_s: float = 120.0) -> str:
        """Run `code` in a Python driver on `node` (default the head) joined to the cluster; its stdout."""
        node = node or self.head
        prelude = f"import ray\nray.init(address={self.gcs_address!r}, logging_level='ERROR')\n"
        result = subprocess.run(node.nsenter([sys.executable, "-c", prelude + code]), env=self.env(node),
                                capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise RuntimeError(f"driver on {node.spec.name} failed: {result.stderr[-3000:]}")
        return result.stdout

    def alive_nodes(self) -> list[dict[str, object]]:
        out = self.python("import json\nprint(json.dumps([{'ip': n['NodeManagerAddress'], 'alive': n['Alive'], "
                          "'resources': n['Resources'], 'labels': n.get('Labels', {})} for n in ray.nodes()]))")
        return [n for n in json.loads(out.strip().splitlines()[-1]) if n["alive"]]

    def wait_nodes(self, count: int, timeout_s: float) -> list[dict[str, object]]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                alive = self.alive_nodes()
            except RuntimeError:
                alive = []
            if len(alive) >= count:
                return alive
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(alive)} of {count} Ray nodes alive after {timeout_s:.0f} s")
            time.sleep(1.0)

    def driver(self, argv: Sequence[str], name: str, node: Node | None = None, **env: str) -> subprocess.Popen[bytes]:
        """A long-running process (e.g. `specserve up --address ...`) on `node` (default the head); stopped by
        `stop()`. Its output goes to logs/NAME.log."""
        node = node or self.head
        proc = node.popen(argv, self.env(node, **env), self.logs / f"{name}.log")
        self.drivers.append(proc)
        return proc

    def stop(self) -> None:
        """End every process started here: the drivers (SIGTERM, then their group killed), each node's processes
        (SIGTERM, then SIGKILL), the namespace holders; then the interfaces. Never `ray stop`."""
        for proc in self.drivers:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.drivers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for node in self.nodes:
            node.kill(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(node.pids() for node in self.nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        for node in self.nodes:
            node.kill(signal.SIGKILL)
            if node.holder is not None:
                node.holder.kill()
                node.holder.wait()
        if self.isolated:
            for node in self.nodes:
                subprocess.run(["ip", "link", "delete", node.host_if], capture_output=True)
            subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)
        self.nodes.clear()

    def log_text(self, pattern: str = "**/*") -> str:
        """Every log file under the nodes' temp folders and this cluster's logs matching `pattern`, joined."""
        parts = []
        for path in sorted(self.root.glob(pattern)):
            if path.is_file() and path.suffix in (".log", ".out", ".err"):
                try:
                    parts.append(path.read_text(errors="replace"))
                except OSError:
                    continue
        return "\n".join(parts)
