"""Fault hooks for chaos runs (chaos/, docs/chaos.md): off by default, one attribute check when off.

Each process has one plan, `FAULTS`. A worker checks it where a fault can happen:

    if FAULTS.active and (params := FAULTS.take("verifier.raise")) is not None:
        ...

and a chaos action arms it through the process's own deployment or actor method
(`inject_fault(name, **params)`, `clear_faults()`). Nothing arms a plan unless a chaos run asks, so a
serving process pays one attribute read per hook.

Named faults (where the hook sits; what `params` mean):
    verifier.raise         Verifier.verify: the forward runs (the KV pool is written), then it raises
    verifier.latency       Verifier.verify: sleep `seconds` before answering
    drafter.latency        Drafter.propose: sleep `seconds` before answering
    drafter.garbage        Drafter.propose: `mode` "out_of_range" (ids >= vocabulary) or "wrong_length"
                           (one draft more than asked); the engine must refuse them
    kv.reserve_fail        KV manager: a reserve call raises RetriableKVError
    kv.commit_fail         KV manager: a commit call raises RetriableKVError
    engine.skip_abort_rollback  SpecEngine: an abort forgets the request without releasing its KV (a bug, on
                           purpose: the chaos negative control shows that the invariant checks see the leak)
Common params: `times` (fire at most this many times; default: until cleared), `probability` (each check
fires with it; default 1), `seed` (of the draws).
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any

FAULT_NAMES = frozenset({
    "verifier.raise", "verifier.latency", "drafter.latency", "drafter.garbage",
    "kv.reserve_fail", "kv.commit_fail", "engine.skip_abort_rollback",
})


class InjectedFault(RuntimeError):
    """Raised by a hook on purpose (a chaos run asked for it)."""


@dataclass
class ArmedFault:
    params: dict[str, Any]
    times: int | None  # left; None = until cleared
    probability: float
    fired: int = 0


@dataclass
class FaultPlan:
    active: bool = False  # the one attribute a hook reads when nothing is armed
    faults: dict[str, ArmedFault] = field(default_factory=dict)
    fired: dict[str, int] = field(default_factory=dict)  # every firing since the process started, by name
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _rng: random.Random = field(default_factory=random.Random)

    def inject(self, name: str, times: int | None = None, probability: float = 1.0, seed: int | None = None,
               **params: Any) -> None:
        if name not in FAULT_NAMES:
            raise ValueError(f"unknown fault {name!r}; known: {sorted(FAULT_NAMES)}")
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {probability}")
        with self._lock:
            if seed is not None:
                self._rng.seed(seed)
            self.faults[name] = ArmedFault(dict(params), times, probability)
            self.active = True

    def clear(self, name: str | None = None) -> dict[str, int]:
        """Disarm one fault or all; returns how often each disarmed fault fired."""
        with self._lock:
            names = [name] if name is not None else list(self.faults)
            fired = {n: self.faults.pop(n).fired for n in names if n in self.faults}
            self.active = bool(self.faults)
            return fired

    def take(self, name: str) -> dict[str, Any] | None:
        """The fault's params if it fires now (counted), else None."""
        with self._lock:
            fault = self.faults.get(name)
            if fault is None or (fault.probability < 1.0 and self._rng.random() >= fault.probability):
                return None
            fault.fired += 1
            self.fired[name] = self.fired.get(name, 0) + 1
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    del self.faults[name]
                    self.active = bool(self.faults)
            return fault.params

    def describe(self) -> dict[str, Any]:
        with self._lock:
            armed = {n: {"params": f.params, "times_left": f.times, "probability": f.probability, "fired": f.fired}
                     for n, f in self.faults.items()}
            return {"armed": armed, "fired": dict(self.fired)}


FAULTS = FaultPlan()  # this process's plan

__all__ = ["FAULTS", "FAULT_NAMES", "ArmedFault", "FaultPlan", "InjectedFault"]


class FaultHooks:
    """What every deployment and the KV actor expose to chaos runs (chaos/actions.py), through their handles:
    arm and clear this process's hooks, and report the process id a kill action targets."""

    async def inject_fault(self, name: str, **params: Any) -> None:
        """Arm a fault hook in this process."""
        FAULTS.inject(name, **params)

    async def clear_faults(self) -> dict[str, Any]:
        """Disarm every hook; returns how often each fired."""
        fired = FAULTS.describe()["fired"]
        FAULTS.clear()
        return fired

    async def pid(self) -> int:
        """This process's id (kill actions target it, never a process name)."""
        return os.getpid()
