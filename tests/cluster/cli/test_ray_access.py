"""`specserve up` and Ray's authentication (cluster/cli/ray_access.py): auth off only in a loopback-only network
namespace or with --allow-unauthenticated-ray (whose warning names every listener), else exit 2 with one line before
anything starts; the Ray token file 0600.

Nothing here starts Ray: the refusal is asserted where it exits first (in this process, with the interfaces
injected), and in a namespace built to look reachable (`unshare -rn`, a bridge holding a private address), where
even a refusal that failed would reach nothing outside.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cluster.cli import up
from cluster.cli.main import main
from cluster.cli.ray_access import (
    ALLOW_FLAG,
    Interface,
    auth_off,
    listeners,
    parse_if_inet6,
    ray_auth_gate,
    reachable,
    read_interfaces,
    secure_token_file,
)
from cluster.serving.config import ClusterConfig, load_config

REPO = Path(__file__).resolve().parents[3]
LO = Interface("lo", up=True, loopback=True, addresses=("127.0.0.1", "::1"))
ETH_UP = Interface("eth0", up=True, loopback=False, addresses=("192.0.2.2", "fe80::1"))
ETH_DOWN = Interface("eth0", up=False, loopback=False, addresses=("192.0.2.2",))
ETH_BARE = Interface("eth1", up=True, loopback=False, addresses=())
OFF = {"RAY_AUTH_MODE": "disabled"}

IF_INET6 = """\
00000000000000000000000000000001 01 80 10 80       lo
fd000000000000000000000000000002 04 40 00 80     eth0
fe8000000000000000fc00fffe000001 04 40 20 80     eth0
garbage line
"""


# -- which namespace can be reached ---------------------------------------------------------------------------
def test_if_inet6_is_read_per_interface() -> None:
    assert parse_if_inet6(IF_INET6) == {"lo": ["::1"], "eth0": ["fd00::2", "fe80::fc:ff:fe00:1"]}


def test_interfaces_read_here_carry_the_fake_procs_ipv6_addresses(tmp_path: Path) -> None:
    """The names and flags come from this namespace (if_nameindex, SIOCGIFFLAGS); the IPv6 addresses from the file."""
    fake = tmp_path / "if_inet6"
    names = [name for _, name in socket.if_nameindex()]
    fake.write_text("".join(f"fd0000000000000000000000000000{i:02x} {i:02x} 40 00 80 {name}\n"
                            for i, name in enumerate(names, 1)))
    found = {i.name: i for i in read_interfaces(fake)}
    assert set(found) == set(names)
    assert found["lo"].loopback and "127.0.0.1" in found["lo"].addresses
    for i, name in enumerate(names, 1):
        assert f"fd00::{i:x}" in found[name].addresses
    assert {i.name for i in read_interfaces(tmp_path / "none")} == set(names)  # IPv6 off: IPv4 only


@pytest.mark.parametrize(("interfaces", "exposed"), [
    ([LO], []), ([LO, ETH_DOWN], []), ([LO, ETH_BARE], []), ([LO, ETH_UP], ["eth0"]), ([ETH_UP, ETH_BARE], ["eth0"]),
    ([Interface("lo", True, True, ("10.0.0.1",))], []),  # an address on loopback: nothing outside routes to it
])
def test_reachable_means_up_with_an_address_and_not_loopback(interfaces: list[Interface], exposed: list[str]) -> None:
    assert [i.name for i in reachable(interfaces)] == exposed


def test_auth_is_off_as_ray_decides() -> None:
    assert auth_off({}, joining=False) is None  # a new local cluster: Ray turns token mode on
    assert auth_off({"RAY_AUTH_MODE": "token"}, joining=True) is None
    assert auth_off({"RAY_AUTH_MODE": "Disabled"}, joining=False) == "RAY_AUTH_MODE=Disabled"
    assert auth_off({}, joining=True) == "joining with RAY_AUTH_MODE unset"


# -- the gate ---------------------------------------------------------------------------------------------------
def gate(environ: dict[str, str], interfaces: list[Interface], allow: bool = False, **config: Any) -> str | None:
    return ray_auth_gate(load_config(None, **config), allow, environ, lambda: interfaces)


def test_auth_on_goes_on_without_looking() -> None:
    def unexpected() -> list[Interface]:
        raise AssertionError("interfaces read with auth on")

    assert ray_auth_gate(load_config(None), False, {}, unexpected) is None


def unreadable() -> list[Interface]:
    raise PermissionError(13, "Permission denied")


def test_auth_off_in_a_loopback_only_namespace_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "specserve.up"):
        assert gate(OFF, [LO, ETH_DOWN, ETH_BARE]) is None
    assert "loopback-only network namespace" in caplog.text


def test_auth_off_where_it_can_be_reached_is_one_line_naming_the_way_out() -> None:
    line = gate(OFF, [LO, ETH_UP])
    assert line is not None and "\n" not in line and line.startswith("error: ")
    assert "RAY_AUTH_MODE=disabled" in line and "eth0 (192.0.2.2, fe80::1)" in line and ALLOW_FLAG in line
    assert "scripts/in-netns.sh" in line
    refused = ray_auth_gate(load_config(None), False, OFF, unreadable)
    assert refused is not None and "interfaces unreadable: Permission denied" in refused  # cannot tell = reachable


def test_the_flag_goes_on_and_its_warning_names_every_listener(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "specserve.up"):
        assert gate(OFF, [LO, ETH_UP], allow=True, grpc_port=9123, http_port=8123, dashboard_port=8299) is None
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = warning.getMessage()
    for listener in ("GCS", "raylet", "dashboard agent", "runtime-env agent", "dashboard 127.0.0.1:8299",
                     "core-worker gRPC", "inter-deployment gRPC port on ALL interfaces", "127.0.0.1:8123",
                     "127.0.0.1:9123", "round channels", "chunk inbox", "eth0"):
        assert listener in text, listener
    assert len(listeners(load_config(None, ray_address="ray://h:10001"))) == 4  # joined: not its Ray's own


def test_up_refuses_with_exit_2_and_one_line_before_starting_anything(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr("cluster.cli.ray_access.read_interfaces", lambda: [LO, ETH_UP])
    monkeypatch.setattr(up, "_up", lambda *a: pytest.fail("up went on"))
    assert main(["up", "--model", "smollm2-135m", "--draft", "ngram"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: Ray's authentication is off")
    monkeypatch.setattr(up, "_up", lambda *a: 0)  # with the flag: on to _up
    assert main(["up", "--model", "smollm2-135m", "--draft", "ngram", ALLOW_FLAG]) == 0


def _namespace(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(tmp_path), "SPECSERVE_IN_NETNS": "1"}
    return subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up && " + script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


needs_namespaces = pytest.mark.skipif(
    shutil.which("unshare") is None or shutil.which("ip") is None
    or subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode != 0,
    reason="unprivileged network namespaces refused here")


@needs_namespaces
def test_in_a_namespace_that_looks_reachable_up_exits_2_with_one_line(tmp_path: Path) -> None:
    """A namespace of its own with a bridge up at 10.9.8.7 (reachable, as far as up can tell; in fact isolated)."""
    result = _namespace("ip link add br0 type bridge && ip addr add 10.9.8.7/24 dev br0 && ip link set br0 up && "
                        f"exec {sys.executable} -m cluster.cli up --model smollm2-135m --draft ngram", tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1 and "br0 (10.9.8.7" in result.stderr
    assert not list(tmp_path.iterdir())  # no Ray session was made


@needs_namespaces
def test_a_fresh_namespace_is_loopback_only(tmp_path: Path) -> None:
    result = _namespace(f"exec {sys.executable} -c 'from cluster.cli.ray_access import read_interfaces, reachable; "
                        "print(reachable(read_interfaces()))'", tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


# -- the token file ---------------------------------------------------------------------------------------------
def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_local_clusters_token_file_is_created_0600(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    old_umask = os.umask(0)  # even with a umask that leaves everything
    try:
        assert secure_token_file({}, create=True) is not None
    finally:
        os.umask(old_umask)
    path = tmp_path / ".ray" / "auth_token"
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700 and len(path.read_text()) == 64
    assert secure_token_file({}, create=True) is None  # there already, 0600: left alone
    assert secure_token_file({"RAY_AUTH_MODE": "disabled"}, create=True) is None


@pytest.mark.parametrize(("environ", "create"), [({"RAY_AUTH_MODE": "disabled"}, True),
                                                 ({"RAY_AUTH_TOKEN": "t" * 64}, True),
                                                 ({}, False),  # joining with no mode: Ray's driver stays off
                                                 ({"RAY_AUTH_MODE": "token"}, False)])  # joining: Ray makes none
def test_no_token_file_where_ray_would_make_none(environ: dict[str, str], create: bool, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert secure_token_file(environ, create=create) is None
    assert not (tmp_path / ".ray").exists()


def test_a_lax_token_file_is_set_to_0600_and_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "token"
    path.write_text("t" * 64)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, "specserve.up"):
        assert secure_token_file({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}) is not None
    assert _mode(path) == 0o600 and "had mode 0644" in caplog.text and "t" * 64 not in caplog.text


def test_init_ray_leaves_the_token_file_0600_even_where_ray_writes_it_0644(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """up's init_ray with ray.init replaced by what Ray does to the file (ray/_private/authentication: open(path,
    "w"), so 0644 under the usual umask) when none is there."""
    import ray

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):  # recorded, so restored after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    path = tmp_path / ".ray" / "auth_token"
    seen: list[int] = []

    def fake_init(**kwargs: Any) -> Any:
        seen.append(_mode(path) if path.exists() else -1)
        os.environ["RAY_AUTH_MODE"] = "token"  # what ray.init does for a new local cluster
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            path.write_text("r" * 64)
            path.chmod(0o644)
        return type("Context", (), {"dashboard_url": "127.0.0.1:8265"})()

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ClusterConfig, "local_ray_env", lambda self: None)
    assert up.init_ray(load_config(None)) == "127.0.0.1:8265"
    assert seen == [0o600] and _mode(path) == 0o600  # made before Ray looked for it
    path.chmod(0o644)  # one Ray found lax
    up.init_ray(load_config(None))
    assert _mode(path) == 0o600
