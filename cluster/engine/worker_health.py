"""The engine's view of its two workers: epochs, instances, failures and the drafter's back-off.

    drafter fails    -> its epoch expires (the ledger drops its draft grants); plain decoding; retried with
                        exponential back-off under a new epoch
    drafter replaced -> seen by its worker instance id; a new epoch; every draft cache restarts
    verifier fails   -> its epoch expires (the ledger drops every target entry); a new epoch; every running
                        request is requeued and re-prefilled from its tokens (nothing emitted is lost)

Owner: the engine thread; every method is called from `SpecEngine.step`. `WorkerHealth` holds only
worker state and touches the ledger only to expire and renew epochs. What a failure means for the
requests (restart draft caches, requeue) is the engine's to apply: the methods say when.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cluster.engine.held_commit import HeldCommitKV
from kv_manager.schema import Holder

log = logging.getLogger("specserve.engine")


class WorkerHealth:
    def __init__(self, kv: HeldCommitKV, has_drafter: bool, drafter_retry_seconds: float,
                 max_verifier_failures: int) -> None:
        self._kv = kv
        self._retry_seconds = drafter_retry_seconds
        self._max_verifier_failures = max_verifier_failures
        self._events: list[dict[str, Any]] = []  # fallback events not yet taken by the engine (`take_events`)
        self.verifier_holder: Holder = kv.register_worker("verifier")
        self.drafter_holder: Holder | None = kv.register_worker("drafter") if has_drafter else None
        self._has_drafter = has_drafter
        self._drafter_down_since: float | None = None
        self._drafter_failures = 0  # consecutive; retries back off exponentially
        self._verifier_failures = 0  # consecutive
        self._drafter_instance: str | None = None
        self._verifier_instance: str | None = None

    def take_events(self) -> list[dict[str, Any]]:
        """The fallback events since the last call (the engine adds them to its own at each step's end)."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ drafter
    def drafter_usable(self) -> bool:
        """False while the drafter is backing off; after the back-off, one retry under a new epoch."""
        if not self._has_drafter:
            return False
        if self._drafter_down_since is None:
            return True
        backoff = self._retry_seconds * 2 ** min(self._drafter_failures - 1, 5)
        if time.monotonic() - self._drafter_down_since < backoff:
            return False
        self._drafter_down_since = None  # a replacement may be up
        self.drafter_holder = self._kv.register_worker("drafter")
        self._events.append({"at": time.time(), "event": "drafter retried"})
        return True

    def drafter_failed(self, exc: BaseException) -> None:
        """The drafter died or timed out: its epoch expires (every draft grant of it is rolled back);
        the caller restarts every request's draft cache."""
        self._drafter_failures += 1
        log.error("drafter failed (%s); falling back to plain decoding", exc)
        self._drafter_down_since = time.monotonic()
        self._events.append({"at": time.time(), "event": "drafter unavailable", "error": repr(exc)})
        self._kv.expire_worker("drafter")

    def drafter_answered(self, instance: str) -> bool:
        """True if a new drafter process answered (its pool is empty): the old epoch expired, a new one
        holds from now on, and the caller restarts every request's draft cache."""
        self._drafter_failures = 0
        replaced = self._drafter_instance is not None and instance != self._drafter_instance
        self._drafter_instance = instance
        if replaced:
            log.warning("drafter replaced; re-prefilling draft caches")
            self._events.append({"at": time.time(), "event": "drafter replaced"})
            self._kv.expire_worker("drafter")
            self.drafter_holder = self._kv.register_worker("drafter")
        return replaced

    # ------------------------------------------------------------------ verifier
    def verifier_failed(self, exc: BaseException) -> float:
        """Seconds to back off before the next round; re-raises after too many failures in a row."""
        self._verifier_failures += 1
        if self._verifier_failures > self._max_verifier_failures:
            raise exc
        return min(2.0, 0.05 * 2 ** self._verifier_failures)

    def verifier_answered(self, instance: str) -> bool:
        """True if a new verifier process answered: its KV pool is empty, so the round is lost."""
        replaced = self._verifier_instance is not None and instance != self._verifier_instance
        self._verifier_instance = instance
        if not replaced:
            self._verifier_failures = 0
        return replaced

    def renew_verifier(self, reason: str) -> None:
        """The target KV is gone: expire the verifier's epoch (the ledger drops every target entry of it)
        and hold a new one; the caller requeues every running request."""
        self._events.append({"at": time.time(), "event": "verifier recovery", "reason": reason})
        self._kv.expire_worker("verifier")
        self.verifier_holder = self._kv.register_worker("verifier")
