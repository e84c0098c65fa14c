"""Worker failure handling for SpecEngine: a drafter or verifier that dies, times out or is replaced.

    drafter fails    -> its epoch expires (the ledger drops its draft grants); plain decoding; retried with
                        exponential backoff under a new epoch
    drafter replaced -> detected by its worker instance id; every request re-enters the draft namespace
    verifier fails   -> its epoch expires; every running request is requeued and re-prefilled from its
                        tokens (nothing emitted is lost or repeated)

A mixin of SpecEngine (cluster/engine.py), which owns every attribute used here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cluster.request_state import RequestState
from cluster.round_plan import RoundPlan
from kv_manager.schema import Holder

log = logging.getLogger("specserve.engine")


class WorkerRecovery:
    kv: Any
    config: Any
    drafter: Any
    running: list[RequestState]
    waiting: Any
    fallback_events: list[dict[str, Any]]
    drafter_holder: Holder | None
    verifier_holder: Holder
    _drafter_down_since: float | None
    _drafter_failures: int
    _in_flight_ids: set[str]

    def _drafter_usable(self) -> bool:
        if self.drafter is None:
            return False
        if self._drafter_down_since is None:
            return True
        backoff = self.config.drafter_retry_seconds * 2 ** min(self._drafter_failures - 1, 5)
        if time.monotonic() - self._drafter_down_since >= backoff:
            self._drafter_down_since = None  # try again with a new epoch; a replacement may be up
            self.drafter_holder = self.kv.register_worker("drafter")
            self.fallback_events.append({"at": time.time(), "event": "drafter retried"})
            return True
        return False

    def _on_drafter_replaced(self) -> None:
        """A new drafter process: its pool is empty, so every request re-enters the draft namespace
        (expiring the old epoch drops its grants, this round's reservations included)."""
        log.warning("drafter replaced; re-prefilling draft caches")
        self.fallback_events.append({"at": time.time(), "event": "drafter replaced"})
        self.kv.expire_worker("drafter")
        self.drafter_holder = self.kv.register_worker("drafter")
        for state in self.running:
            state.draft_cached, state.draft_admitted = 0, False

    def _recover_verifier(self, plans: list[RoundPlan], reason: str) -> None:
        """The target KV is gone: expire the verifier's epoch, roll back this round and requeue every
        running request; it is re-admitted and re-prefilled from its tokens (nothing emitted is lost)."""
        log.error("%s; re-prefilling %d running requests", reason, len(self.running))
        self.fallback_events.append({"at": time.time(), "event": "verifier recovery", "reason": reason})
        self.kv.rollback([(self.config.draft_namespace, p.state.request_id) for p in plans if p.uses_model_drafter])
        self.kv.expire_worker("verifier")
        self.verifier_holder = self.kv.register_worker("verifier")
        for state in reversed(self.running):
            if state.request_id in self._in_flight_ids:
                continue  # its group's drafts are in flight; requeued when they land (not in running)
            state.target_cached, state.admitted = 0, False
            self.running.remove(state)
            self.waiting.appendleft(state)

    def _on_drafter_failure(self, plans: list[RoundPlan], exc: Exception) -> None:
        self._drafter_failures += 1
        log.error("drafter failed (%s); falling back to plain decoding", exc)
        self._drafter_down_since = time.monotonic()
        self.fallback_events.append({"at": time.time(), "event": "drafter unavailable", "error": repr(exc)})
        self.kv.expire_worker("drafter")  # rolls back every draft-namespace grant of the dead epoch
        for p in plans:
            p.uses_model_drafter, p.k, p.drafts, p.draft_probs = False, 0, [], None
            p.state.record_k(0, "fallback: drafter failed, plain decoding")
        for state in self.running:
            state.draft_cached, state.draft_admitted = 0, False
