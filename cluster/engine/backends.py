"""What the engine calls once per round: a verifier and (optionally) a drafter, in process
(verifier_service / drafter_service workers) or remote (cluster/serving/remote_backends.py)."""

from __future__ import annotations

from typing import Protocol

from specserve_types.round_messages import ProposeBatch, ProposeResult, VerifyBatch, VerifyResult


class VerifierBackend(Protocol):
    def verify(self, batch: VerifyBatch) -> VerifyResult: ...


class DrafterBackend(Protocol):
    def propose(self, batch: ProposeBatch) -> ProposeResult: ...


class DrafterUnavailable(RuntimeError):
    """The draft model's worker is gone; requests continue by plain decoding."""
