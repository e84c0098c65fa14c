"""What the engine calls once per round: a verifier and (optionally) a drafter, in process
(verifier_service / drafter_service workers) or remote (cluster/serving/remote_backends.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from specserve_types.round_messages import ProposeBatch, ProposeResult, VerifyBatch, VerifyResult


class VerifierBackend(Protocol):
    def verify(self, batch: VerifyBatch, on_sent: Callable[[], None] | None = None) -> VerifyResult:
        """Score `batch`; `on_sent()` runs once the request is on its way (a remote verifier: the caller's work
        overlaps the forward), or before the forward (in process)."""
        ...


class DrafterBackend(Protocol):
    def propose(self, batch: ProposeBatch) -> ProposeResult: ...


class DrafterUnavailable(RuntimeError):
    """The draft model's worker is gone; requests continue by plain decoding."""
