"""Overlap: two groups of requests in ping-pong, so drafting one hides behind verifying the other.

    step t   : land(A): A's drafts -> verify(A) on the engine thread  ||  propose(B) on the draft thread
    step t+1 : land(B): B's drafts -> verify(B)                       ||  propose(A)

Plan and reserve run on the engine thread (the engine plans group B and reserves its KV before it
verifies A); `DraftPipeline` only carries the drafter call across the step.

Ownership: the engine thread calls every method here and owns everything it hands over. The draft
thread runs `propose(batch)` on a `ProposeBatch` value built on the engine thread, and nothing else: it
touches no RequestState, no RoundPlan and no ledger. `InFlight` is the engine thread's record of a group
whose drafts are being made; its requests stay in the engine's running list, and an abort of one of them
waits until the group lands (the drafter is writing its draft KV blocks).

Pre-drafting (predraft.py) uses the same draft thread with one group: its flight (`PREDRAFT`) starts after
the round's own propose and lands after that round's verify, within the step (no abort ever waits for it).
Whether there is a draft thread at all is overlap_policy.py's decision.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from cluster.engine.round_plan import RoundPlan
from kv_manager.schema import Holder
from specserve_types.round_messages import ProposeBatch, ProposeResult

Timed = tuple[ProposeResult, float]  # the drafter's answer and the call's wall time
PREDRAFT = 2  # the flight key of a step's pre-drafts (groups 0 and 1 are the ping-pong's)


@dataclass
class InFlight:
    plans: list[RoundPlan]  # the group's plans, reserved on the engine thread
    model_plans: list[RoundPlan]  # those whose drafts the draft model makes
    future: Future[Timed] | None  # None: nothing for the draft model in this group
    drafter_holder: Holder | None  # the drafter epoch the batch was reserved under

    @property
    def request_ids(self) -> set[str]:
        return {p.state.request_id for p in self.plans}


class DraftPipeline:
    def __init__(self, propose: Callable[[ProposeBatch], ProposeResult]) -> None:
        self._propose = propose
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-draft")
        self._in_flight: dict[int, InFlight] = {}
        self._turn = 0
        self._turns_without_plans = 0  # consecutive ping-pong turns in which no plan got a reservation

    def next_turn(self) -> int:
        """The group verified this step (0, 1, 0, ...)."""
        turn, self._turn = self._turn, self._turn ^ 1
        return turn

    def out_of_blocks(self, planned: bool, idle: bool) -> bool:
        """A ping-pong turn ended (`planned`: its group verifies plans): whether to preempt an idle request, when no
        group reserved anything in a whole cycle (or nothing else is in flight)."""
        self._turns_without_plans = 0 if planned else self._turns_without_plans + 1
        if planned or not idle or (self.busy() and self._turns_without_plans < 2):
            return False
        self._turns_without_plans = 0
        return True

    def in_flight_ids(self) -> set[str]:
        return {rid for flight in self._in_flight.values() for rid in flight.request_ids}

    def has(self, group: int) -> bool:
        return group in self._in_flight

    def busy(self) -> bool:
        return bool(self._in_flight)

    def submit(self, group: int, plans: list[RoundPlan], model_plans: list[RoundPlan], batch: ProposeBatch | None,
               drafter_holder: Holder | None) -> None:
        assert group not in self._in_flight, f"group {group} is already in flight"
        future = self._pool.submit(self._timed, batch) if batch is not None else None
        self._in_flight[group] = InFlight(plans, model_plans, future, drafter_holder)

    def take(self, group: int) -> InFlight | None:
        """The group's flight, if any; the caller waits on its future (on the engine thread)."""
        return self._in_flight.pop(group, None)

    def drain(self) -> list[InFlight]:
        """Every flight, after its drafter call ended (answers and failures alike are the caller's to drop)."""
        flights = list(self._in_flight.values())
        self._in_flight.clear()
        for flight in flights:
            if flight.future is not None:
                flight.future.exception()  # waits; a failed call is discarded with its drafts
        return flights

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _timed(self, batch: ProposeBatch) -> Timed:
        start = time.perf_counter()
        result = self._propose(batch)
        return result, time.perf_counter() - start
