"""What the engine calls once per round: a verifier and (optionally) a drafter, in process
(verifier_service / drafter_service workers) or remote (cluster/serving/remote_backends.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from specserve_types.round_messages import ProposeBatch, ProposeResult, VerifyBatch, VerifyResult


class VerifierBackend(Protocol):
    def verify(self, batch: VerifyBatch) -> VerifyResult: ...


def verify_then(verifier: VerifierBackend, batch: VerifyBatch, on_sent: Callable[[], None]) -> VerifyResult:
    """`verifier.verify(batch)`, with `on_sent()` run once the request is on its way where the verifier is remote
    and says so (`sends_then_waits`: the hook's work overlaps the verifier's), else before the call."""
    if getattr(verifier, "sends_then_waits", False):
        return verifier.verify(batch, on_sent=on_sent)  # type: ignore[call-arg]
    on_sent()
    return verifier.verify(batch)


class DrafterBackend(Protocol):
    def propose(self, batch: ProposeBatch) -> ProposeResult: ...


class DrafterUnavailable(RuntimeError):
    """The draft model's worker is gone; requests continue by plain decoding."""
