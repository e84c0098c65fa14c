"""Overlap for SpecEngine: two groups of requests in ping-pong, so drafting one hides behind verifying the other.

    step t   : verify(group A) on the engine thread  ||  plan+reserve+propose(group B) on the draft thread
    step t+1 : verify(group B)                       ||  plan+reserve+propose(group A)

A mixin of SpecEngine (cluster/engine/engine.py), which owns every attribute used here and provides `_plan`,
`_reserve`, `_propose` and `_preempt`; the draft thread only runs `_prepare` for the group that is not
being verified.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cluster.engine.request_state import RequestState
from cluster.engine.round_plan import RoundPlan


class OverlapRounds:
    kv: Any
    running: list[RequestState]
    _turn: int
    _in_flight: dict[int, Future]
    _in_flight_ids: set[str]
    _turns_without_plans: int
    _draft_pool: ThreadPoolExecutor
    _namespaces: list[str]

    def _prepare(self, states: list[RequestState]) -> tuple[list[RoundPlan], float]:
        plans = self._reserve([self._plan(s) for s in states], may_preempt=False)
        return plans, self._propose(plans)

    def _overlapped_prepare(self) -> tuple[list[RoundPlan], float]:
        turn = self._turn
        self._turn ^= 1
        mine = [s for s in self.running if s.group == turn]
        others = [s for s in self.running if s.group != turn]
        future = self._in_flight.pop(turn, None)
        if future is not None:
            plans, draft_seconds = future.result()
            # the future prepared this whole group, requests refused a reservation (no plan) included:
            # none is in flight any more, so each may be aborted, preempted or planned again
            self._in_flight_ids.difference_update(s.request_id for s in mine)
            stale = [p for p in plans if p.state not in self.running]
            self.kv.rollback([(ns, p.state.request_id) for p in stale for ns in self._namespaces])
            plans = [p for p in plans if p.state in self.running]
        elif mine:
            plans, draft_seconds = self._prepare(mine)
        else:
            plans, draft_seconds = [], 0.0
        if others and (1 - turn) not in self._in_flight:
            self._in_flight_ids.update(s.request_id for s in others)
            self._in_flight[1 - turn] = self._draft_pool.submit(self._prepare, others)
        self._turns_without_plans = 0 if plans else self._turns_without_plans + 1
        idle = [s for s in self.running if s.request_id not in self._in_flight_ids]
        # out of blocks: no group reserved anything in a whole cycle (or the other group is empty)
        if not plans and idle and (not self._in_flight or self._turns_without_plans >= 2):
            self._preempt(idle[-1])
            self._turns_without_plans = 0
        return plans, draft_seconds
