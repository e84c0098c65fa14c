"""Worker failure handling for SpecEngine: a drafter or verifier that dies, times out or is replaced.

    drafter fails    -> its epoch expires (the ledger drops its draft grants); plain decoding; retried with
                        exponential backoff under a new epoch
    drafter replaced -> detected by its worker instance id; every request re-enters the draft namespace
    verifier fails   -> its epoch expires; every running request gives back its draft cache too, is
                        requeued and re-prefilled from its tokens (nothing emitted is lost or repeated)

`reconcile_ledger` checks the ledger against the engine (tests call it after every run): only running
requests hold entries (a waiting request holds none), and none is left once every request ended.

A mixin of SpecEngine (cluster/engine/engine.py), which owns every attribute used here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cluster.engine.request_state import RequestState
from cluster.engine.round_plan import RoundPlan
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
    _namespaces: list[str]

    def reconcile_ledger(self) -> None:
        """Assert that the ledger holds entries only for running requests (those in flight included), so
        none for a waiting or ended request, and none at all once every request ended. One ledger call
        per namespace; call it between steps."""
        running = {state.request_id for state in self.running}
        assert self._in_flight_ids <= running, f"in flight but not running: {sorted(self._in_flight_ids - running)}"
        for namespace in self._namespaces:
            held = set(self.kv.request_ids(namespace))
            assert held <= running, f"{namespace}: the ledger holds {sorted(held - running)}, which are not running"

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
        """The target KV is gone: expire the verifier's epoch and requeue every running request with its
        draft cache released (a waiting request holds nothing in the ledger, so an abort while it waits
        leaves nothing behind); it is re-admitted and re-prefilled from its tokens (nothing emitted is lost)."""
        log.error("%s; re-prefilling %d running requests", reason, len(self.running))
        self.fallback_events.append({"at": time.time(), "event": "verifier recovery", "reason": reason})
        # each plan's request is requeued below, and releasing its draft cache returns this round's reservation
        assert all(p.state in self.running and p.state.request_id not in self._in_flight_ids for p in plans)
        self.kv.expire_worker("verifier")
        self.verifier_holder = self.kv.register_worker("verifier")
        for state in reversed(self.running):
            if state.request_id in self._in_flight_ids:
                continue  # its group's drafts are in flight; requeued when they land (not in running)
            if state.draft_admitted:  # this round's draft reservation goes with it
                self.kv.release(state.request_id, [self.config.draft_namespace])
            state.target_cached, state.admitted = 0, False
            state.draft_cached, state.draft_admitted = 0, False
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
