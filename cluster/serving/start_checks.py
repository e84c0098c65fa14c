"""What the replicas read as they start, read first by `specserve up` before anything starts: a configuration they
cannot use is then one line and exit 2, not replicas that fail their constructor again and again (a traceback in
each one's log) while `up` waits for them.

    api keys   KeySources.load, as the ingress does (cluster/serving/auth.py): a key file unreadable or holding no
               key, a key under MIN_KEY_CHARS characters (the config's, SPECSERVE_API_KEYS', the file's)
    tls        tls_cert_file and tls_key_file readable, PEM, and a pair (the key is the certificate's; one under a
               passphrase neither door can use), as Python's ssl loads them for Serve's HTTP proxy (uvicorn)
    ports      grpc_port and http_port free on `host`: nothing listens there, the address is this machine's, and a
               port below 1024 only with the privilege to bind it
    traces     trace_file's folder can be made and the file appended to (each process's exporter does both)

A joined cluster (`ray_address`) reads its files and its environment and binds its ports on its own nodes: only the
keys written in the config are checked here. The models are checked by `up`'s preflight (cluster/cli/up.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from cluster.serving.auth import AuthError
from cluster.serving.config import ClusterConfig

__all__ = ["start_problems"]


def start_problems(config: ClusterConfig, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Every problem found, each on one line (none: the replicas can start with this configuration)."""
    local = config.ray_address is None
    sources = config.key_sources()
    if not local:
        sources = dataclasses.replace(sources, key_file=None, use_env=False)
    problems: list[str] = []
    try:
        sources.load(environ)
    except AuthError as exc:
        problems.append(str(exc))
    if not local:
        return problems
    if config.tls_cert_file is not None and config.tls_key_file is not None:
        problems += tls_problems(config.tls_cert_file, config.tls_key_file)
    problems += port_problems(config.host, {"grpc_port": config.grpc_port, "http_port": config.http_port})
    if config.trace_file is not None and (problem := trace_file_problem(config.trace_file)) is not None:
        problems.append(problem)
    return problems


def _no_passphrase() -> NoReturn:
    raise ValueError("the private key is under a passphrase: neither door can use it")


def tls_problems(cert_file: str, key_file: str) -> list[str]:
    """The certificate and key as both doors read them: each readable, then the two a PEM pair."""
    unreadable = []
    for name, path in (("tls_cert_file", cert_file), ("tls_key_file", key_file)):
        try:
            Path(path).read_bytes()
        except OSError as exc:
            unreadable.append(f"{name} {path}: cannot read it ({exc.strerror or type(exc).__name__})")
    if unreadable:
        return unreadable
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file, password=_no_passphrase)
    except ValueError as exc:
        return [f"tls_key_file {key_file}: {exc}"]
    except ssl.SSLError as exc:
        reason = re.sub(r" \(_ssl\.c:\d+\)$", "", str(exc))
        if exc.reason == "KEY_VALUES_MISMATCH":
            return [f"tls_key_file {key_file} is not the key of tls_cert_file {cert_file} ({reason})"]
        return [f"tls_cert_file {cert_file} and tls_key_file {key_file} are not a PEM certificate and its private key "
                f"({reason})"]
    return []


def port_problems(host: str, ports: Mapping[str, int]) -> list[str]:
    """Each port that cannot be bound on `host` (SO_REUSEADDR, as the servers bind: a closed connection's lingering
    TIME_WAIT does not count, a listener does)."""
    problems = []
    for name, port in ports.items():
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
        except socket.gaierror as exc:
            return [f"host {host}: cannot resolve it ({exc.strerror})"]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                problems.append(f"{name} {port}: cannot bind {host}:{port} ({exc.strerror})")
    return problems


def trace_file_problem(path: str) -> str | None:
    try:
        Path(path).absolute().parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        return f"trace_file {path}: cannot append to it ({exc.strerror or type(exc).__name__})"
    return None
