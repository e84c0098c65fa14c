"""The verify phase's call: ONE verifier call, with the ledger call that rides beside it (the held commit and the
next round's reservation windows, held_commit.py: sent once the verify is on its way, landed after it).

    call_verifier(...) -> VerifyCall(result, seconds)   or raises VerifierLost (the round is lost: the caller requeues)

It changes no engine state: the ahead call records its own times (`Ahead.send_seconds`, `wait_seconds`), which the
engine adds to its totals. Owner: the engine thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from cluster.engine.backends import VerifierBackend
from cluster.engine.held_commit import Ahead, HeldCommitKV
from cluster.engine.step_trace import StepTrace
from cluster.engine.worker_health import WorkerHealth
from specserve_types.round_messages import VerifyBatch, VerifyResult

log = logging.getLogger("specserve.engine")


class VerifierLost(Exception):
    """This round's verify produced nothing usable: the call failed or a new verifier process answered."""


@dataclass(frozen=True)
class VerifyCall:
    result: VerifyResult
    seconds: float  # result.seconds + the hop (the ahead call's sending is the ledger's: in process, all of it)


def call_verifier(verifier: VerifierBackend, kv: HeldCommitKV, health: WorkerHealth, trace: StepTrace,
                  batch: VerifyBatch, ahead: Ahead | None) -> VerifyCall:
    call_start = time.perf_counter()
    try:
        with trace.phase("verify.forward", requests=len(batch.items),
                         tokens=sum(len(i.input_ids) + len(i.draft_ids) for i in batch.items)):
            result = verifier.verify(batch, on_sent=ahead.send if ahead is not None else None)
    except Exception as exc:
        if ahead is not None:
            _land(kv, ahead, quiet=True)
        time.sleep(health.verifier_failed(exc))  # re-raises after too many failures in a row
        raise VerifierLost(f"verifier failed: {exc!r}") from exc
    if ahead is not None:
        _land(kv, ahead)
    if health.verifier_answered(result.worker_instance):
        raise VerifierLost("verifier replaced (new process, empty KV pool)")
    return VerifyCall(result, time.perf_counter() - call_start - (ahead.send_seconds if ahead else 0.0))


def _land(kv: HeldCommitKV, ahead: Ahead, quiet: bool = False) -> None:
    """The ahead call's answer. `quiet`: the round is lost anyway (the verifier failed), a failed ledger call is
    only logged."""
    try:
        kv.land_ahead(ahead)
    except Exception:
        if not quiet:
            raise
        log.warning("the ledger call beside a failed verify failed too", exc_info=True)


__all__ = ["VerifierLost", "VerifyCall", "call_verifier"]
