"""Each client's share of the scheduler: completions and tokens in flight per client, and the limits on them.

A client is what the ingress names in `GenerateArgs.client` (cluster/serving/auth.py `client_id`): an API key's id
(a short hash of the key, never the key), or its connection's (peer address and port) where the server has no keys. "" (a caller that
names none: tests, in-process use) is one client like any other.

    completions   the client's admitted completions not yet finished or aborted (a request counts its n)
    tokens        prompt + n x max_tokens of each of its live requests: the KV it may come to hold
    limits        `max_client_completions` (default half of queue_capacity) and `max_client_tokens` (default half of
                  max_batch x max_context), ClusterConfig; past either -> a capacity refusal (HTTP 429 /
                  RESOURCE_EXHAUSTED with the retry hint), as for a full server. A client that holds nothing is
                  always within them (queue_capacity still applies), so every request that is valid on its own
                  can run: a limit bounds what a client adds to what it holds.

The completions are counted before the prompt is tokenized (a refusal costs nothing), the tokens once it is
(`take_tokens`); between the two nothing awaits, so a client cannot overshoot. The engine orders the admitted
requests fairly between clients (cluster/engine/fair_share.py, `GenerationRequest.tenant`).
Owner: the scheduler replica's event loop (`Scheduler.generate` takes and gives back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ClientLimits", "ClientShares", "Share"]


@dataclass(frozen=True)
class ClientLimits:
    completions: int  # completions in flight a client may hold
    tokens: int  # prompt + n x max_tokens over its live requests

    @classmethod
    def defaults(cls, queue_capacity: int, max_batch: int, max_context: int) -> ClientLimits:
        """Half the queue, and half of a full batch's contexts: one client leaves the other half to the others."""
        return cls(max(1, queue_capacity // 2), max(1, max_batch * max_context // 2))


@dataclass(frozen=True)
class Share:
    completions: int = 0
    tokens: int = 0

    def __add__(self, other: Share) -> Share:
        return Share(self.completions + other.completions, self.tokens + other.tokens)

    def __sub__(self, other: Share) -> Share:
        return Share(self.completions - other.completions, self.tokens - other.tokens)


class ClientShares:
    """Per-client counters against `limits`; `on_change(client, share)` after each change (the metrics), and
    `on_refusal(client, limit)` for each refusal ("completions" or "tokens")."""

    def __init__(self, limits: ClientLimits, on_change: Callable[[str, Share], None] | None = None,
                 on_refusal: Callable[[str, str], None] | None = None) -> None:
        self.limits = limits
        self._shares: dict[str, Share] = {}  # clients holding something
        self._on_change = on_change
        self._on_refusal = on_refusal

    def of(self, client: str) -> Share:
        return self._shares.get(client, Share())

    def clients(self) -> dict[str, Share]:
        return dict(self._shares)

    def take_completions(self, client: str, count: int) -> str | None:
        """Count `count` completions for `client`, or the refusal's message (nothing counted)."""
        held = self.of(client).completions
        return self._take(client, Share(completions=count), held + count, self.limits.completions, "completions",
                          f"{held} completions in flight, max_client_completions={self.limits.completions}")

    def take_tokens(self, client: str, tokens: int) -> str | None:
        """Count `tokens` for `client` (its completions are counted already), or the refusal's message."""
        held = self.of(client).tokens
        return self._take(client, Share(tokens=tokens), held + tokens, self.limits.tokens, "tokens",
                          f"{held} tokens in flight (prompt + n x max_tokens of its requests) and this request's "
                          f"{tokens}, max_client_tokens={self.limits.tokens}")

    def _take(self, client: str, more: Share, after: int, limit: int, name: str, why: str) -> str | None:
        """Add `more` to the client's share unless it holds some of `name` already and would hold `after` > `limit`
        (a client holding none is always within); otherwise the refusal's message, nothing counted."""
        if after > limit and after > more.completions + more.tokens:
            return self._refuse(client, name, why)
        self._set(client, self.of(client) + more)
        return None

    def give_back(self, client: str, completions: int, tokens: int) -> None:
        self._set(client, self.of(client) - Share(completions, tokens))

    def _refuse(self, client: str, limit: str, why: str) -> str:
        if self._on_refusal is not None:
            self._on_refusal(client, limit)
        return f"this client's share of the server is full: {why}; retry later"

    def _set(self, client: str, share: Share) -> None:
        assert share.completions >= 0 and share.tokens >= 0, (client, share)
        if share == Share():
            self._shares.pop(client, None)
        else:
            self._shares[client] = share
        if self._on_change is not None:
            self._on_change(client, share)
