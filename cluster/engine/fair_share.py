"""Fair shares of the batch between tenants: which waiting request is admitted next, and who gives up a slot.

A request's tenant is `GenerationRequest.tenant` (in the cluster an API key's id, or a connection's where the
server has no keys: cluster/serving/auth.py `client_id`; "" is the one shared tenant of in-process use).

    order     the next request admitted is the oldest waiting one of the tenant with the fewest requests in the
              batch (ties: the tenant whose oldest waiting request came first), so tenants take the free slots in
              turn and a tenant with one request waits for one slot, however many another tenant queued. Within a
              tenant the queue stays first come, first served (a requeued request first). With one tenant this is
              the FIFO the engine always had.
    yield     when the batch is full and a tenant waits with at least two requests fewer in the batch than the
              tenant with the most, that tenant's most recently admitted request gives its slot up: preempted as
              for KV memory (give_back.py: its KV given back, its blocks left to the prefix cache, requeued at the
              head of its tenant's queue, re-prefilled from its tokens; nothing emitted is lost). One tenant gains
              a slot, the other loses one, so the gap shrinks by two and no pair of tenants trades back and forth.
              A request whose drafts are in flight (two-group overlap, pre-drafting) or that prefills its prompt
              group's shared prompt is never chosen.

The per-tenant limits (requests, tokens in flight) are the scheduler's (cluster/serving/client_shares.py): by the
time a request is here its tenant was within them. `admissions` makes the decisions one by one, and the engine
applies each before the next is made (engine.py `_admit`). Owner: the engine thread.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator, Sequence

from cluster.engine.admission import admit_target, running
from cluster.engine.held_commit import HeldCommitKV
from cluster.engine.request_state import RequestState
from cluster.engine.shared_prompts import SharedPrompts
from cluster.engine.worker_health import WorkerHealth

ADMIT, YIELD = "admit", "yield"


def tenant_of(state: RequestState) -> str:
    return state.request.tenant


def awaits_prefill(state: RequestState) -> bool:
    """A prompt group's member whose group's shared prompt is not prefilled yet: it cannot be admitted now."""
    group = state.prompt_group
    return group is not None and group.prefiller_id != state.request_id and not group.namespaces


def prefills_group(state: RequestState) -> bool:
    group = state.prompt_group
    return group is not None and group.prefiller_id == state.request_id


class FairOrder:
    """One step's admission order over the waiting requests (built from the queue at the start of `_admit`)."""

    def __init__(self, waiting: Iterable[RequestState], running: Iterable[RequestState]) -> None:
        # tenant -> its waiting requests with their places in the queue, first come first
        self.queues: dict[str, collections.deque[tuple[int, RequestState]]] = {}
        for place, state in enumerate(waiting):
            self.queues.setdefault(tenant_of(state), collections.deque()).append((place, state))
        self.running: collections.Counter[str] = collections.Counter(tenant_of(state) for state in running)
        self._passed: set[str] = set()  # tenants whose head cannot be admitted this step
        self._requeued = 0  # places before the queue's first, for requests requeued at its head

    def next(self) -> RequestState | None:
        """The request to admit next (None: no tenant has one that may be tried this step)."""
        best: tuple[int, int, RequestState] | None = None
        for tenant, queue in self.queues.items():
            if queue and tenant not in self._passed:
                place, state = queue[0]
                if best is None or (self.running[tenant], place) < best[:2]:
                    best = (self.running[tenant], place, state)
        return best[2] if best is not None else None

    def admitted(self, state: RequestState) -> None:
        tenant = tenant_of(state)
        _, head = self.queues[tenant].popleft()
        assert head is state
        self.running[tenant] += 1

    def pass_over(self, state: RequestState) -> None:
        """`state`'s tenant waits this step (its head waits for its group's prefill); the others may go on."""
        self._passed.add(tenant_of(state))

    def to_yield(self, running: Sequence[RequestState], in_flight: set[str]) -> RequestState | None:
        """The running request that gives its slot up to a tenant short of its share (None: shares are fair
        enough, or none may be chosen)."""
        needy = self.next()
        if needy is None or awaits_prefill(needy):
            return None
        richest, most = max(self.running.items(), key=lambda item: item[1], default=("", 0))
        if self.running[tenant_of(needy)] + 1 >= most:
            return None
        for state in reversed(running):  # the most recently admitted first
            if tenant_of(state) == richest and state.request_id not in in_flight and not prefills_group(state):
                return state
        return None

    def yielded(self, state: RequestState) -> None:
        """`state` was preempted (requeued at the head of the waiting queue): its tenant's head now."""
        tenant = tenant_of(state)
        self.running[tenant] -= 1
        self._requeued -= 1
        self.queues.setdefault(tenant, collections.deque()).appendleft((self._requeued, state))


def admissions(waiting: Sequence[RequestState], batch: Sequence[RequestState], max_batch: int, lookahead: int,
               kv: HeldCommitKV, shared: SharedPrompts, health: WorkerHealth, in_flight: Callable[[], set[str]]
               ) -> Iterator[tuple[str, RequestState]]:
    """Waiting requests join the batch, tenants in turn: (ADMIT, a request admitted in the ledger, its overlap
    group set) or (YIELD, a running request to preempt for a tenant short of its share); the caller applies each to
    its lists (`waiting`, `batch`: read live) before the next is made. Stops where memory is short."""
    if not waiting:
        return
    order = FairOrder(waiting, batch)
    in_flight_ids: set[str] | None = None
    for _ in range(len(waiting) + max_batch):  # each pass admits, yields or passes over one
        if len(batch) >= max_batch:  # full: a slot yielded to a tenant short of its share, then filled
            in_flight_ids = in_flight() if in_flight_ids is None else in_flight_ids
            if (victim := order.to_yield(batch, in_flight_ids)) is None:
                return
            yield YIELD, victim
            order.yielded(victim)
        if (state := order.next()) is None:
            return
        if awaits_prefill(state):
            order.pass_over(state)  # its group's prompt is being prefilled: other tenants may go first
            continue
        forked = shared.fork(state, lookahead, health.verifier_holder)  # a group's member
        if forked is False:
            return  # memory is short
        if forked is None and not admit_target(kv, state, health.verifier_holder, lookahead):
            return  # memory pressure: wait for running requests to finish
        order.admitted(state)
        sizes = [sum(1 for r in batch if r.group == g) for g in (0, 1)]
        running(state, 0 if sizes[0] <= sizes[1] else 1)
        yield ADMIT, state


__all__ = ["ADMIT", "YIELD", "FairOrder", "admissions", "awaits_prefill", "prefills_group", "tenant_of"]
