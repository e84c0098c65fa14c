"""The verify phase, as a function on values: constrained requests' rows (their allowed tokens, forbidden drafts
cut), then ONE verifier call, with the ledger call that rides beside it (the held commit and the next round's
reservation windows, held_commit.py: sent once the verify is on its way, landed after it).

    verify_round(...) -> VerifyCall(plans, result, totals)   or raises VerifierLost (the round is lost: the caller
                                                             requeues; its `totals` too)

It changes no engine state: the phase's counts and times come back in `totals`, which the engine adds to its own;
the collaborators passed in change only themselves (the ledger client, `WorkerHealth`, the cost model's samples).
Owner: the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cluster.engine.backends import VerifierBackend
from cluster.engine.held_commit import Ahead, HeldCommitKV
from cluster.engine.round_plan import RoundPlan, constrained, verify_item
from cluster.engine.spec_policy import CostModel
from cluster.engine.step_trace import StepTrace
from cluster.engine.worker_health import WorkerHealth
from kv_manager.schema import ReserveItem
from specserve_types.round_messages import VerifyBatch, VerifyResult

log = logging.getLogger("specserve.engine")


class VerifierLost(Exception):
    """This round's verify produced nothing usable: the call failed or a new verifier process answered."""

    def __init__(self, reason: str, totals: Mapping[str, float]) -> None:
        super().__init__(reason)
        self.totals = totals  # the phase's counts and times until it was lost (VerifyCall.totals)


@dataclass(frozen=True)
class VerifyCall:
    plans: list[RoundPlan]  # as verified (a constraint may have cut drafts)
    result: VerifyResult
    # constraint_cut; verify_call_seconds: result.seconds + the hop (the ahead call's sending is the ledger's: in
    # process, all of it); kv_seconds, kv_ahead_wait_seconds: the ahead call's, its wait after the verify its share
    totals: Mapping[str, float]


def verify_round(verifier: VerifierBackend, kv: HeldCommitKV, health: WorkerHealth, trace: StepTrace,
                 cost: CostModel, plans: list[RoundPlan], exact_rule: str,
                 windows: Callable[[list[RoundPlan]], list[ReserveItem] | None] | None) -> VerifyCall:
    """The round's verify; `windows`: the reservation windows the verified plans ask for on the ledger call beside
    it (None, or it answers None: no such call)."""
    totals: dict[str, float] = {}
    if any(p.state.constraint is not None for p in plans):
        with trace.phase("constrain"):
            plans = [constrained(p) for p in plans]  # each row's allowed tokens; forbidden drafts cut
        totals["constraint_cut"] = sum(p.cut for p in plans)
    items = [verify_item(p, exact_rule) for p in plans]
    trace.begin(plans)
    items_ahead = windows(plans) if windows is not None else None
    ahead = kv.ahead(items_ahead) if items_ahead is not None else None
    try:
        result, seconds = _call(verifier, kv, health, trace, VerifyBatch(items, trace.trace_context), ahead)
    except VerifierLost as lost:
        raise VerifierLost(str(lost), totals | _ahead_totals(ahead)) from lost.__cause__
    cost.observe_verify(sum(len(i.input_ids) + len(i.draft_ids) for i in items), result.seconds)
    return VerifyCall(plans, result, totals | _ahead_totals(ahead) | {"verify_call_seconds": seconds})


def _ahead_totals(ahead: Ahead | None) -> dict[str, float]:
    if ahead is None:
        return {}
    return {"kv_seconds": ahead.wait_seconds + ahead.send_seconds, "kv_ahead_wait_seconds": ahead.wait_seconds}


def _call(verifier: VerifierBackend, kv: HeldCommitKV, health: WorkerHealth, trace: StepTrace, batch: VerifyBatch,
          ahead: Ahead | None) -> tuple[VerifyResult, float]:
    call_start = time.perf_counter()
    try:
        with trace.phase("verify.forward", requests=len(batch.items),
                         tokens=sum(len(i.input_ids) + len(i.draft_ids) for i in batch.items)):
            result = verifier.verify(batch, on_sent=ahead.send if ahead is not None else None)
    except Exception as exc:
        if ahead is not None:
            _land(kv, ahead, quiet=True)
        time.sleep(health.verifier_failed(exc))  # re-raises after too many failures in a row
        raise VerifierLost(f"verifier failed: {exc!r}", {}) from exc
    if ahead is not None:
        _land(kv, ahead)
    if health.verifier_answered(result.worker_instance):
        raise VerifierLost("verifier replaced (new process, empty KV pool)", {})
    return result, time.perf_counter() - call_start - (ahead.send_seconds if ahead else 0.0)


def _land(kv: HeldCommitKV, ahead: Ahead, quiet: bool = False) -> None:
    """The ahead call's answer. `quiet`: the round is lost anyway (the verifier failed), a failed ledger call is
    only logged."""
    try:
        kv.land_ahead(ahead)
    except Exception:
        if not quiet:
            raise
        log.warning("the ledger call beside a failed verify failed too", exc_info=True)


__all__ = ["VerifierLost", "VerifyCall", "verify_round"]
