"""API keys of the front doors: which keys a request may present, and the check, in constant time.

    sources   ClusterConfig.api_keys (a config file), ClusterConfig.api_key_file (one key a line; `#` starts a
              comment; `specserve up --api-key-file`, a mounted Kubernetes Secret), and the environment variable
              SPECSERVE_API_KEYS (keys separated by commas or blanks) of the process that serves
    several   every listed key is accepted: add the new key, move the clients, remove the old one (rotation)
    none      no key configured anywhere = the front doors are open (what `specserve up` on loopback does)
    check     HTTP `Authorization: Bearer KEY`, gRPC metadata `authorization: Bearer KEY`; each presented key is
              compared with every configured key by hmac.compare_digest (no early exit), so the time taken
              says nothing about how much of a key was right
    open      HTTP /health, the gRPC health service and SpecServe.Health (probes carry no key); /metrics unless
              `metrics_require_api_key`; server reflection (it lists the schema, which is public)

A key never leaves this module: refusals say "missing" or "invalid", never which key was sent.

    client    who a request is, for the scheduler's per-client shares (cluster/serving/client_shares.py) and the
              engine's fair order: `client_id` = "key-" and 12 hex digits of a SHA-256 of the key it passed with,
              or, with no key configured, "peer-" and those of its connection's peer address and port (HTTP: the
              connection's client (host, port); gRPC: `context.peer()`, one channel = one client): without keys
              a connection is the only identity there is. The id goes into GenerateArgs, stats and metric labels;
              the key itself never leaves this module. 48 bits of a key of 16+ characters give nothing back; a
              peer's id can be matched against guessed addresses (addresses are not secret)
Owner: the ingress replica's event loop (`reload` runs from its health check).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

__all__ = ["ENV_API_KEYS", "ApiKeys", "AuthError", "KeySources", "bearer_token", "client_id", "grpc_peer",
           "http_peer", "parse_key_file"]

ENV_API_KEYS = "SPECSERVE_API_KEYS"
MIN_KEY_CHARS = 16  # a key short enough to guess is a configuration error, not a key
BEARER = "bearer "


CLIENT_ID_HEX = 12


def client_id(key: str | None, peer: str | None) -> str:
    """A request's client: its API key's id where it passed with one (the server has keys), else its connection's
    (`peer`: "host:port", as `http_peer` / `grpc_peer` spell it)."""
    if key is not None:
        return "key-" + hashlib.sha256(b"specserve api key\0" + key.encode()).hexdigest()[:CLIENT_ID_HEX]
    return "peer-" + hashlib.sha256(b"specserve peer\0" + (peer or "unknown").encode()).hexdigest()[:CLIENT_ID_HEX]


def _normal_host(host: str) -> str:
    """One spelling per address (an IPv4 address mapped into IPv6 is the IPv4 one); other names as they are."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def http_peer(client: tuple[str, int] | None) -> str | None:
    """An ASGI scope's `client` (host, port) as "host:port" (None: unknown, e.g. a Unix socket)."""
    if client is None:
        return None
    host, port = client
    return f"{_normal_host(host)}:{port}"


def grpc_peer(peer: str | None) -> str | None:
    """grpc.aio's `context.peer()` as "host:port": "ipv4:127.0.0.1:5000" -> "127.0.0.1:5000", "ipv6:[::1]:5000"
    (or percent-encoded) -> "::1:5000", "unix:/path" as it is."""
    if not peer:
        return None
    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    host, _, port = rest.rpartition(":")
    return f"{_normal_host(host)}:{port}" if host and port.isdigit() else rest


class AuthError(ValueError):
    """The key configuration cannot be used (unreadable file, a key too short); raised at start."""


def parse_key_file(text: str) -> list[str]:
    """One key a line; blank lines and `#` comments skipped (a key holds no blank and no `#`)."""
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]


def _env_keys(environ: Mapping[str, str]) -> list[str]:
    return environ.get(ENV_API_KEYS, "").replace(",", " ").split()


def bearer_token(value: str | None) -> str | None:
    """The KEY of `Bearer KEY` (scheme case-insensitive), else None."""
    if value is None or not value[:len(BEARER)].lower() == BEARER:
        return None
    token = value[len(BEARER):].strip()
    return token or None


@dataclass(frozen=True)
class KeySources:
    """Where the keys come from; `load()` reads them (the file and the environment at that moment)."""

    keys: tuple[str, ...] = field(default=(), repr=False)
    key_file: str | None = None
    use_env: bool = True  # also SPECSERVE_API_KEYS of this process

    def load(self, environ: Mapping[str, str] = os.environ) -> tuple[tuple[str, ...], float | None]:
        """(keys, the file's mtime or None); AuthError names the file or the short key's source, never a key."""
        found = [("config", key) for key in self.keys] + [
            (ENV_API_KEYS, key) for key in (_env_keys(environ) if self.use_env else ())]
        mtime = None
        if self.key_file is not None:
            path = Path(self.key_file)
            try:
                mtime = path.stat().st_mtime
                found += [(str(path), key) for key in parse_key_file(path.read_text())]
            except (OSError, UnicodeDecodeError) as exc:
                raise AuthError(f"api_key_file {path}: cannot read it ({type(exc).__name__})") from None
            if not any(source == str(path) for source, _ in found):
                raise AuthError(f"api_key_file {path}: holds no key")
        short = sorted({source for source, key in found if len(key) < MIN_KEY_CHARS})
        if short:
            raise AuthError(f"API keys must have at least {MIN_KEY_CHARS} characters; shorter ones in: {short}")
        return tuple(dict.fromkeys(key for _, key in found)), mtime


class ApiKeys:
    """The accepted keys, shared by both front doors. `accepts(presented)`: whether a request may pass (always
    True when no key is configured); `reload()` re-reads a key file that changed (a rotated Secret)."""

    def __init__(self, sources: KeySources = KeySources()) -> None:
        self._sources = sources
        keys, self._mtime = sources.load()
        self._keys = tuple(key.encode() for key in keys)

    @classmethod
    def of(cls, *keys: str) -> ApiKeys:
        return cls(KeySources(keys=keys, use_env=False))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:  # never the keys
        return f"ApiKeys({len(self._keys)} keys)"

    def accepts(self, presented: str | None) -> bool:
        if not self._keys:
            return True
        if presented is None:
            return False
        candidate = presented.encode()
        matched = False
        for key in self._keys:  # every key compared, match or not
            matched |= hmac.compare_digest(candidate, key)
        return matched

    def client(self, presented: str | None, peer: str | None) -> str:
        """The client id of a request that passed `accepts` (`client_id`): its key's id when the server has keys,
        else its connection's."""
        return client_id(presented if self._keys else None, peer)

    def reload(self) -> bool:
        """Re-read the key file if it changed since it was read; returns whether the keys were replaced. A file
        that cannot be used now raises AuthError and leaves the keys in force."""
        if self._sources.key_file is None:
            return False
        try:
            mtime: float | None = Path(self._sources.key_file).stat().st_mtime
        except OSError:
            mtime = None
        if mtime == self._mtime:
            return False
        keys, self._mtime = self._sources.load()
        self._keys = tuple(key.encode() for key in keys)
        return True
