"""The state one chaos run shares between the runner and the experiments' actions and probes (chaoslib
calls them as plain functions in this process)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from chaos.load import LoadGenerator, RequestRecord, RequestSpec
from chaos.nodes import ExtraNodes


@dataclass
class FaultEvent:
    at: float  # wall clock
    fault: str
    detail: str = ""


@dataclass
class RunState:
    grpc_address: str
    http_base: str
    model: str
    workload: list[RequestSpec]
    seed: int = 0
    load: LoadGenerator | None = None
    records: list[RequestRecord] = field(default_factory=list)
    faults: list[FaultEvent] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fired: dict[str, object] = field(default_factory=dict)  # clear_faults: how often each hook fired, per target
    nodes: ExtraNodes | None = None  # a node-loss scenario's extra Ray nodes (chaos/nodes.py)

    def fault(self, name: str, detail: str = "") -> None:
        self.faults.append(FaultEvent(time.time(), name, detail))


_current: RunState | None = None


def begin(state: RunState) -> RunState:
    global _current
    _current = state
    return state


def current() -> RunState:
    if _current is None:
        raise RuntimeError("no chaos run in progress (chaos.runner sets one up before running an experiment)")
    return _current
