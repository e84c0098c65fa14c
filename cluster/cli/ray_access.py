"""Who may reach the Ray that `specserve up` starts or joins: Ray's authentication off only where nothing can reach
it, and the token file readable by its owner only (docs/security.md, "Ray token").

    auth on      (Ray's default for a local cluster, RAY_AUTH_MODE=token): nothing to decide here; the token file
                 (~/.ray/auth_token) is created 0600 before Ray would write it 0644, and a lax one is set to 0600
    auth off     (RAY_AUTH_MODE=disabled, or joining with no mode and no token) goes on only
                   - in a network namespace whose only live interface is loopback (what scripts/in-netns.sh makes):
                     every other interface is down or has no address, so no other machine can connect; or
                   - with --allow-unauthenticated-ray, which logs every listener that then opens to anyone who
                     reaches the machine (LISTENERS)
                 otherwise `up` exits 2 with one line on stderr, before anything starts

Interfaces are read in this process's own network namespace: their names from if_nameindex(3), their flags and IPv4
address from the SIOCGIFFLAGS / SIOCGIFADDR ioctls, their IPv6 addresses from /proc/self/net/if_inet6 (not
/sys/class/net, which shows the namespace that mounted sysfs). A namespace that cannot be read counts as reachable.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import stat
import struct
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cluster.serving.config import ClusterConfig

log = logging.getLogger("specserve.up")

ALLOW_FLAG = "--allow-unauthenticated-ray"
IF_INET6 = Path("/proc/self/net/if_inet6")
IFF_UP = 0x1
IFF_LOOPBACK = 0x8
SIOCGIFFLAGS = 0x8913
SIOCGIFADDR = 0x8915
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
IFREQ = struct.Struct("256s")  # struct ifreq, padded: the name, then the union the ioctl fills


@dataclass(frozen=True)
class Interface:
    name: str
    up: bool
    loopback: bool
    addresses: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.name} ({', '.join(self.addresses)})"


def parse_if_inet6(text: str) -> dict[str, list[str]]:
    """/proc/net/if_inet6: `ADDRESS(32 hex) IFINDEX PREFIXLEN SCOPE FLAGS NAME` per line -> name: addresses."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 6 or len(fields[0]) != 32:
            continue
        try:
            address = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0]))
        except ValueError:
            continue
        found.setdefault(fields[5], []).append(address)
    return found


def _ioctl(sock: socket.socket, request: int, name: str) -> bytes | None:
    import fcntl

    try:
        return fcntl.ioctl(sock.fileno(), request, IFREQ.pack(name.encode()[:15]))
    except OSError as exc:
        if exc.errno in (errno.EADDRNOTAVAIL, errno.ENODEV):  # no IPv4 address / gone meanwhile
            return None
        raise


def read_interfaces(if_inet6: Path = IF_INET6) -> list[Interface]:
    """This network namespace's interfaces (Linux); OSError where they cannot be read."""
    if not sys.platform.startswith("linux"):
        raise OSError(errno.ENOSYS, "interfaces are read on Linux only")
    try:
        v6 = parse_if_inet6(if_inet6.read_text())
    except FileNotFoundError:  # IPv6 off in this kernel: no IPv6 addresses
        v6 = {}
    interfaces = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            flags_reply = _ioctl(sock, SIOCGIFFLAGS, name)
            if flags_reply is None:
                continue
            flags = struct.unpack_from("H", flags_reply, 16)[0]
            addr_reply = _ioctl(sock, SIOCGIFADDR, name)  # struct sockaddr_in at 16: family, port, address
            v4 = [socket.inet_ntoa(addr_reply[20:24])] if addr_reply is not None else []
            interfaces.append(Interface(name, bool(flags & IFF_UP), bool(flags & IFF_LOOPBACK),
                                        tuple(v4 + v6.get(name, []))))
    return interfaces


def reachable(interfaces: Iterable[Interface]) -> list[Interface]:
    """The interfaces another machine could connect through: not loopback, up, with an address."""
    return [i for i in interfaces if not i.loopback and i.up and i.addresses]


def auth_off(environ: Mapping[str, str], joining: bool) -> str | None:
    """Why this process's Ray would run without authentication (None: it runs with a token), as Ray decides it
    (ray/_private/worker.py): RAY_AUTH_MODE when set; unset, a new local cluster turns token mode on, and a driver
    joining an address stays off."""
    mode = environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return None if mode.strip().lower() == "token" else f"RAY_AUTH_MODE={mode}"
    return "joining with RAY_AUTH_MODE unset" if joining else None


def listeners(config: ClusterConfig) -> list[str]:
    """What opens under `up`, and what each accepts once Ray's authentication is off (docs/security.md,
    "Listeners under `up`", measured with `ss -ltnp`)."""
    node = "127.0.0.1" if config.host in LOOPBACK_HOSTS else "the node's address"
    opened = []
    if not config.ray_address:
        opened += [f"Ray's GCS, raylet (node and object manager), dashboard agent (gRPC, HTTP 52365, metrics), "
                   f"runtime-env agent and the dashboard's and autoscaler's metrics (free ports on {node}; the GCS "
                   "and raylet run any code)",
                   f"Ray's dashboard 127.0.0.1:{config.dashboard_port} (its Jobs API runs any code)"]
    opened += [f"every Ray worker's core-worker gRPC port (this driver, the Serve controller and proxy, each replica, "
               f"the KV manager; free ports on {node}; runs tasks)",
               "each Serve replica's inter-deployment gRPC port on ALL interfaces (*:free port, whatever --host "
               "says; unpickles a request without a credential: runs any code)",
               f"Serve's HTTP proxy {config.host}:{config.http_port} and the ingress's gRPC "
               f"{config.host}:{config.grpc_port} (the API keys, where configured)",
               f"the round channels of the verifier, drafter and KV manager and each ingress's chunk inbox (free "
               f"ports on {node}; their HMAC secrets are handed out through Ray, so to anyone now)"]
    return opened


def ray_auth_gate(config: ClusterConfig, allow: bool, environ: Mapping[str, str] = os.environ,
                  interfaces: Callable[[], list[Interface]] | None = None) -> str | None:
    """None: `up` may go on (the decision is logged); else the one line to print before exiting 2."""
    why = auth_off(environ, joining=bool(config.ray_address))
    if why is None:
        return None
    try:
        seen = ", ".join(i.describe() for i in reachable((interfaces or read_interfaces)())) or None
    except OSError as exc:
        seen = f"interfaces unreadable: {exc.strerror or exc}"
    if seen is None:
        log.info("Ray authentication off (%s) in a loopback-only network namespace: no other machine can connect",
                 why)
        return None
    if allow:
        log.warning("Ray authentication off (%s) and %s given: reachable from %s, anyone who reaches them may "
                    "connect to: %s", why, ALLOW_FLAG, seen, "; ".join(listeners(config)))
        return None
    return (f"error: Ray's authentication is off ({why}) outside a loopback-only network namespace (reachable: "
            f"{seen}): anyone who reaches this machine could run code through Ray; leave RAY_AUTH_MODE unset or "
            f"'token', run under scripts/in-netns.sh, or pass {ALLOW_FLAG} (docs/security.md)")


# -- the token file ------------------------------------------------------------------------------------------------


def token_path(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The token file Ray reads (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token); None when RAY_AUTH_TOKEN holds it."""
    if environ.get("RAY_AUTH_TOKEN"):
        return None
    return Path(environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def secure_token_file(environ: Mapping[str, str] = os.environ, create: bool = False) -> str | None:
    """With token mode on (or about to be: a new local cluster and no mode), the token file readable by its owner
    only: created 0600 where Ray would create it (`create`: a new local cluster, the default path, none yet; Ray's own
    write would be 0644), or a lax one set to 0600. Logs and returns what was done (None: nothing to do)."""
    mode = environ.get("RAY_AUTH_MODE")
    if (mode is not None and mode.strip().lower() != "token") or (mode is None and not create):
        return None
    path = token_path(environ)
    if path is None:
        return None
    try:
        current = path.stat().st_mode
    except FileNotFoundError:
        if not create or environ.get("RAY_AUTH_TOKEN_PATH"):
            return None  # Ray says it is missing
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, secrets.token_hex(32).encode())  # Ray's own format (authentication_token_generator.py)
        finally:
            os.close(fd)
        log.info("Ray token created in %s (mode 0600)", path)
        return f"created {path} 0600"
    if not current & (stat.S_IRWXG | stat.S_IRWXO):
        return None
    was = stat.S_IMODE(current)
    try:
        path.chmod(0o600)
    except OSError as exc:
        log.warning("Ray token file %s has mode %04o (other local users may read it) and cannot be set to 0600: %s",
                    path, was, exc.strerror)
        return f"left {path} {was:04o}"
    log.warning("Ray token file %s had mode %04o (other local users could read it): set to 0600", path, was)
    return f"fixed {path} {was:04o} -> 0600"
