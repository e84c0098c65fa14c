"""What one engine step did, for observers (traces, metrics): its phases' wall-clock spans and each request's round.

The engine fills a `StepRecord` only when an observer is attached (`SpecEngine.observer`); without one the
phases cost a None check. Observers get the finished record once per step, on the engine thread, and must
not keep references into engine state (a record holds plain values only).

    phases  kv.reserve, draft.propose, verify.forward, accept, kv.commit, emit (batch-wide: one per step)
    rounds  one RoundRecord per request verified this step (k, proposed, accepted, emitted, ...)
    rollbacks  (request id, reason, trace carrier) for KV given back outside a commit: abort, preemption,
            verifier loss
    fallbacks  the kinds of the engine's fallback events this step (drafter failure, preemption, ...)

Owner: the engine thread (docs/ARCHITECTURE.md §3).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

Carrier = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Phase:
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True)
class RoundRecord:
    request_id: str
    trace_context: Carrier  # the request's W3C carrier (empty: not traced)
    k: int  # planned draft length
    drafts_made: int  # drafts the drafter proposed (0: a plain round); a spec step when > 0
    proposed: int  # drafts counted as proposed (those after a stop inside the accepted run were never needed)
    accepted: int  # drafts kept
    emitted: int  # tokens emitted this round (kept accepted drafts + correction/bonus, cut at a stop)
    contract: str
    draft: str  # model | ngram | suffix | none
    finish_reason: str | None
    tree_nodes: int = 0  # a token tree's nodes (0: a chain); `proposed` then counts its depth
    accepted_ranks: tuple[int, ...] = ()  # a tree's accepted nodes' sibling ranks, root first

    @property
    def first_rejected(self) -> int | None:
        """Draft position (1-based) of the first rejected draft; None when every draft survived."""
        return self.accepted + 1 if self.accepted < self.proposed else None


@dataclass(frozen=True)
class Rollback:
    request_id: str
    trace_context: Carrier
    reason: str
    at_ns: int


@dataclass
class StepRecord:
    start_ns: int
    end_ns: int = 0
    batch_size: int = 0
    drafter: str | None = None  # the drafter epoch's holder (process instance) this step
    verifier: str | None = None
    phases: list[Phase] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    rollbacks: list[Rollback] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)  # the engine's fallback events of this step (their kind)
    carrier: Carrier = ()  # the step's host round span (begun by an observer), sent with the worker calls
    host: Any = None  # that span, owned by the observer that began it
    host_request: str | None = None

    @contextmanager
    def phase(self, name: str, **attributes: Any) -> Iterator[dict[str, Any]]:
        """Time a phase; the yielded dict takes attributes learnt inside it."""
        start = time.time_ns()
        try:
            yield attributes
        finally:
            self.phases.append(Phase(name, start, time.time_ns(), attributes))

    def add_phase(self, name: str, seconds: float, **attributes: Any) -> None:
        """A phase that ran elsewhere and just ended (overlap: drafts made during the last verify)."""
        end = time.time_ns()
        self.phases.append(Phase(name, end - int(seconds * 1e9), end, attributes))


class EngineObserver(Protocol):
    def step(self, record: StepRecord) -> None: ...

    def begin(self, record: StepRecord, traced: list[tuple[str, Carrier]]) -> None:
        """Once the step's requests are planned: (request id, carrier) of those traced. An observer may begin
        a span here and set `record.carrier` so the worker calls continue the trace."""


class Observers:
    """Several observers as one (traces and metrics), called in order."""

    def __init__(self, observers: list[EngineObserver]) -> None:
        self.observers = observers

    def step(self, record: StepRecord) -> None:
        for observer in self.observers:
            observer.step(record)

    def begin(self, record: StepRecord, traced: list[tuple[str, Carrier]]) -> None:
        for observer in self.observers:
            observer.begin(record, traced)


def new_step_record() -> StepRecord:
    return StepRecord(start_ns=time.time_ns())
