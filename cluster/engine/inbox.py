"""Requests and aborts from any thread, drained by the engine thread at the start of each step.

Owner: `RequestInbox._lock` guards its three containers; `put`, `abort` and `forget` may be called from any
thread (the serving loop, tests, the CLI), `drain` only from the engine thread. A request id is known from
`put` until the engine forgets it (finished or aborted), so a duplicate in-flight id is refused at once.
"""

from __future__ import annotations

import collections
import threading

from cluster.engine.request_state import RequestState
from specserve_types.api import CapacityError, InvalidRequestError


class RequestInbox:
    def __init__(self, max_waiting: int) -> None:
        self._max_waiting = max_waiting
        self._lock = threading.Lock()
        self._states: collections.deque[RequestState] = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._known_ids: set[str] = set()

    def put(self, state: RequestState, waiting: int) -> None:
        """Enqueue, or raise (changing nothing) for a duplicate id or a full queue (`waiting` already queued)."""
        with self._lock:
            if state.request_id in self._known_ids:
                raise InvalidRequestError("request_id", f"duplicate request id {state.request_id!r}")
            if waiting + len(self._states) >= self._max_waiting:
                raise CapacityError(f"queue full ({self._max_waiting} waiting requests)")
            self._known_ids.add(state.request_id)
            self._states.append(state)

    def put_group(self, states: list[RequestState], waiting: int, reserved: tuple[str, ...] = ()) -> None:
        """Enqueue all of `states` or none (the n completions of one request); `reserved`: further ids known
        from now on (a prompt group's ledger key), forgotten with `forget` like a request's."""
        with self._lock:
            ids = [state.request_id for state in states] + list(reserved)
            seen: set[str] = set()
            for rid in ids:
                if rid in self._known_ids or rid in seen:
                    raise InvalidRequestError("request_id", f"duplicate request id {rid!r}")
                seen.add(rid)
            if waiting + len(self._states) + len(states) > self._max_waiting:
                raise CapacityError(f"queue full ({self._max_waiting} waiting requests)")
            self._known_ids.update(ids)
            self._states.extend(states)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def forget(self, request_id: str) -> None:
        """The request ended: its id may be used again."""
        with self._lock:
            self._known_ids.discard(request_id)

    def drain(self, defer: set[str]) -> tuple[list[RequestState], list[str]]:
        """(new requests, aborts to apply now); aborts of ids in `defer` stay queued for a later step."""
        with self._lock:
            states, aborts = list(self._states), list(self._aborts)
            self._states.clear()
            self._aborts.clear()
            self._aborts.extend(rid for rid in aborts if rid in defer)
        return states, [rid for rid in aborts if rid not in defer]

    def queued(self) -> int:
        with self._lock:
            return len(self._states)

    def pending(self) -> bool:
        with self._lock:
            return bool(self._states or self._aborts)
