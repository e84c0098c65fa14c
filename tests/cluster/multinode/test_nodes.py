"""The multi-node cluster itself: every node up on its own address, Ray's token authentication on."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.multinode.conftest import ROLE_LABEL, ROLES, needs_own_addresses
from tests.cluster.multinode.netns_cluster import NetnsCluster

pytestmark = pytest.mark.timeout(300)


def test_every_node_is_up_with_its_role(netns_cluster: NetnsCluster) -> None:
    alive = netns_cluster.alive_nodes()
    by_role = {n["labels"].get(ROLE_LABEL): n for n in alive}  # type: ignore[union-attr]
    assert sorted(by_role) == sorted(ROLES.values())
    for node in netns_cluster.nodes:
        role = ROLES[node.spec.name]
        assert by_role[role]["ip"] == node.address
        assert by_role[role]["resources"][f"specserve-{role}"] == 100  # type: ignore[index]
        assert node.pids(), node.spec.name  # its processes are found (what node loss and stop kill)


def test_nodes_have_their_own_addresses(netns_cluster: NetnsCluster) -> None:
    needs_own_addresses(netns_cluster)
    assert len({node.address for node in netns_cluster.nodes}) == len(netns_cluster.nodes)
    for node in netns_cluster.nodes:
        # its interface is its own: one address besides loopback, in its own namespace
        addresses = node.sh("ip -4 -o addr show").split()
        assert f"{node.address}/24" in addresses and not any(
            a.endswith("/24") and a != f"{node.address}/24" for a in addresses)


def test_token_auth_is_on(netns_cluster: NetnsCluster) -> None:
    assert stat.S_IMODE(netns_cluster.token_file.stat().st_mode) == 0o600
    # a driver with another token is refused by the GCS
    env = netns_cluster.env(netns_cluster.head)
    wrong = netns_cluster.root / "wrong_token"
    wrong.write_text("0" * 64)
    wrong.chmod(0o600)
    env["RAY_AUTH_TOKEN_PATH"] = str(wrong)
    code = f"import ray\nray.init(address={netns_cluster.gcs_address!r})\nprint(len(ray.nodes()))"
    result = subprocess.run(netns_cluster.head.nsenter([sys.executable, "-c", code]), env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stdout
    assert "token" in result.stderr.lower(), result.stderr[-2000:]
    # with the cluster's token the same driver joins
    assert json.loads(netns_cluster.python("print(len(ray.nodes()))").strip().splitlines()[-1]) == len(ROLES)


def test_nodes_memory(netns_cluster: NetnsCluster) -> None:
    """What the idle nodes hold (resident memory of every process in their namespaces), printed for the docs."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for node in netns_cluster.nodes:
        for pid in node.pids():
            try:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
            except (OSError, IndexError, ValueError):
                continue
    print(f"\n{len(netns_cluster.nodes)} idle Ray nodes: {total / 2**30:.2f} GiB resident")
    assert total > 0
