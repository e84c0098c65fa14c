"""Typed refusals of the KV-block ledger. A call that raises one of these changed nothing.

    KVError
    |-- OutOfBlocks          not enough free blocks now; retry after others finish, or preempt
    |-- ExceedsCapacity      would not fit even in an empty namespace; never admit this plan
    |-- UnknownNamespace     no namespace of that name
    |-- UnknownRequest       no live request of that id in the namespace
    |-- DuplicateRequest     the request id is already live in the namespace
    |-- StaleEpoch           the holder (worker, epoch) is dead, or is not the request's holder
    |-- ReservationInFlight  the request already has an uncommitted reservation
    |-- InvalidSize          a negative or zero size, an empty prompt, a bad config
    |-- InvalidCommit        no reservation to commit (double commit), beyond the reservation,
    |                        token count or accepted path not matching
    |-- InconsistentLiveState  a rebuild's live state contradicts itself (kv_manager/rebuild.py)
    `-- RetriableKVError     the round's call is void (the manager died during it, or an injected fault)
        `-- LedgerRestarted  a call under an earlier incarnation: the client rebuilds the ledger from its live
                             state (kv_manager/live_state.py) and calls again
"""

from __future__ import annotations

from typing import Any


class KVError(Exception):
    """Base of every ledger refusal; `namespace` and `request_id` say which request it concerns."""

    def __init__(self, message: str, *, namespace: str | None = None, request_id: str | None = None) -> None:
        super().__init__(message)
        self.namespace = namespace
        self.request_id = request_id

    def __reduce__(self) -> tuple[Any, ...]:
        # keep the keyword fields when the error crosses a process boundary (Ray, pickle)
        return (self.__class__, (str(self),), self.__dict__)


class OutOfBlocks(KVError):
    pass


class ExceedsCapacity(KVError):
    pass


class UnknownNamespace(KVError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class UnknownRequest(KVError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class DuplicateRequest(KVError):
    pass


class StaleEpoch(KVError):
    pass


class ReservationInFlight(KVError):
    pass


class InvalidSize(KVError, ValueError):
    pass


class InvalidCommit(KVError, ValueError):
    pass


class InconsistentLiveState(KVError, ValueError):
    pass


class RetriableKVError(KVError):
    pass


class LedgerRestarted(RetriableKVError):
    pass
