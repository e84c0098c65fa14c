"""Bad input gets a typed error and leaves the ledger exactly as it was (snapshot before == after)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kv_manager import (
    BlockLedger,
    CommitItem,
    DuplicateRequest,
    ExceedsCapacity,
    Holder,
    InvalidCommit,
    InvalidSize,
    KVError,
    NamespaceConfig,
    OutOfBlocks,
    ReservationInFlight,
    ReserveItem,
    StaleEpoch,
    UnknownNamespace,
    UnknownRequest,
)
from tests.kv_manager.kv_helpers import TARGET, prefill, reserve


@dataclass
class Scene:
    """idle: 5 committed tokens; idle2: 1; busy: 3 committed + 3 reserved; 11 of 16 blocks free."""

    ledger: BlockLedger
    holder: Holder
    other: Holder  # a live worker that holds nothing
    dead: Holder


@pytest.fixture
def scene(ledger: BlockLedger) -> Scene:
    holder = ledger.register_worker("w0")
    other = ledger.register_worker("w1")
    dead = ledger.register_worker("gone")
    ledger.expire_worker("gone")
    prefill(ledger, TARGET, "idle", [1, 2, 3, 4, 5], holder)
    prefill(ledger, TARGET, "busy", [1, 2, 3], holder)
    reserve(ledger, TARGET, "busy", 3, holder)
    prefill(ledger, TARGET, "idle2", [7], holder)
    assert ledger.pools[TARGET].num_free == 11
    return Scene(ledger, holder, other, dead)


def _commit(
    s: Scene, accepted_len: int, token_ids: list[int], path: list[int] | None = None, *, rid: str = "busy",
    holder: Holder | None = None,
) -> object:
    return s.ledger.commit_one(CommitItem(TARGET, rid, accepted_len, token_ids, holder or s.holder, path))


def _reserve(s: Scene, rid: str, num_slots: int, holder: Holder | None = None, namespace: str = TARGET) -> object:
    return s.ledger.reserve_one(ReserveItem(namespace, rid, num_slots, holder or s.holder))


BAD_CALLS: dict[str, tuple[type[KVError], Callable[[Scene], object]]] = {
    "reserve unknown namespace": (UnknownNamespace, lambda s: _reserve(s, "idle", 1, namespace="nope")),
    "reserve unknown request": (UnknownRequest, lambda s: _reserve(s, "ghost", 1)),
    "commit unknown request": (UnknownRequest, lambda s: _commit(s, 0, [], rid="ghost")),
    "rollback unknown request": (UnknownRequest, lambda s: s.ledger.rollback(TARGET, "ghost")),
    "release unknown request": (UnknownRequest, lambda s: s.ledger.release(TARGET, "ghost")),
    "fork unknown parent": (UnknownRequest, lambda s: s.ledger.fork(TARGET, "ghost", "child")),
    "getter unknown request": (UnknownRequest, lambda s: s.ledger.block_table(TARGET, "ghost")),
    "commit without reservation": (InvalidCommit, lambda s: _commit(s, 0, [], rid="idle")),
    "commit beyond reservation": (InvalidCommit, lambda s: _commit(s, 4, [1, 2, 3, 4])),
    "commit token count mismatch": (InvalidCommit, lambda s: _commit(s, 2, [1])),
    "commit path not increasing": (InvalidCommit, lambda s: _commit(s, 2, [1, 2], [1, 0])),
    "commit path outside reservation": (InvalidCommit, lambda s: _commit(s, 2, [1, 2], [0, 3])),
    "commit path length mismatch": (InvalidCommit, lambda s: _commit(s, 2, [1, 2], [0])),
    "commit negative accepted_len": (InvalidSize, lambda s: _commit(s, -1, [])),
    "reserve negative size": (InvalidSize, lambda s: _reserve(s, "idle", -3)),
    "reserve zero size": (InvalidSize, lambda s: _reserve(s, "idle", 0)),
    "reserve over capacity": (ExceedsCapacity, lambda s: _reserve(s, "idle", 64)),
    "reserve out of blocks": (OutOfBlocks, lambda s: _reserve(s, "idle", 55)),
    "reserve while in flight": (ReservationInFlight, lambda s: _reserve(s, "busy", 1)),
    "fork while in flight": (ReservationInFlight, lambda s: s.ledger.fork(TARGET, "busy", "child")),
    "fork onto live request": (DuplicateRequest, lambda s: s.ledger.fork(TARGET, "idle", "busy")),
    "add duplicate request": (DuplicateRequest, lambda s: s.ledger.add_request(TARGET, "idle", [1], s.holder)),
    "add empty prompt": (InvalidSize, lambda s: s.ledger.add_request(TARGET, "new", [], s.holder)),
    "add over-capacity prompt": (ExceedsCapacity, lambda s: s.ledger.add_request(TARGET, "new", [1] * 65, s.holder)),
    "add unknown namespace": (UnknownNamespace, lambda s: s.ledger.add_request("nope", "new", [1], s.holder)),
    "add with dead holder": (StaleEpoch, lambda s: s.ledger.add_request(TARGET, "new", [1], s.dead)),
    "reserve with dead holder": (StaleEpoch, lambda s: _reserve(s, "idle", 1, s.dead)),
    "commit with dead holder": (StaleEpoch, lambda s: _commit(s, 1, [1], holder=s.dead)),
    "commit with another holder": (StaleEpoch, lambda s: _commit(s, 1, [1], holder=s.other)),
    "rollback with another holder": (StaleEpoch, lambda s: s.ledger.rollback(TARGET, "busy", s.other)),
    "over-capacity plan": (ExceedsCapacity, lambda s: s.ledger.can_admit({TARGET: 65})),
    "negative plan": (InvalidSize, lambda s: s.ledger.can_admit({TARGET: -1})),
    "plan for unknown namespace": (UnknownNamespace, lambda s: s.ledger.can_admit({"nope": 1})),
    "free fraction unknown namespace": (UnknownNamespace, lambda s: s.ledger.free_fraction("nope")),
    "atomic batch, last item out of blocks": (
        OutOfBlocks,
        lambda s: s.ledger.reserve(  # 5 + 7 new blocks, 11 free: each fits alone, not both
            [ReserveItem(TARGET, "idle", 20, s.holder), ReserveItem(TARGET, "idle2", 28, s.holder)], atomic=True
        ),
    ),
    "atomic batch naming a request twice": (
        InvalidSize,
        lambda s: s.ledger.reserve([ReserveItem(TARGET, "idle", 1, s.holder)] * 2, atomic=True),
    ),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_call_is_refused_with_a_typed_error_and_changes_nothing(scene: Scene, case: str) -> None:
    error_type, call = BAD_CALLS[case]
    before = scene.ledger.snapshot()
    with pytest.raises(error_type) as refusal:
        call(scene)
    assert isinstance(refusal.value, KVError)
    assert scene.ledger.snapshot() == before


def test_double_commit_is_refused(scene: Scene) -> None:
    _commit(scene, 2, [4, 5])
    before = scene.ledger.snapshot()
    with pytest.raises(InvalidCommit, match="double commit"):
        _commit(scene, 2, [4, 5])
    assert scene.ledger.snapshot() == before


def test_refusals_in_a_batch_come_back_per_item_and_change_nothing(scene: Scene) -> None:
    before = scene.ledger.snapshot()
    outcomes = scene.ledger.reserve(
        [ReserveItem(TARGET, "ghost", 1, scene.holder), ReserveItem(TARGET, "busy", 1, scene.holder)]
    )
    assert [type(o) for o in outcomes] == [UnknownRequest, ReservationInFlight]
    assert outcomes[0].request_id == "ghost"
    outcomes = scene.ledger.commit(
        [CommitItem(TARGET, "idle", 0, [], scene.holder), CommitItem(TARGET, "busy", 9, [0] * 9, scene.holder)]
    )
    assert [type(o) for o in outcomes] == [InvalidCommit, InvalidCommit]
    assert scene.ledger.snapshot() == before


@pytest.mark.parametrize(
    "make",
    [
        lambda: NamespaceConfig(TARGET, num_blocks=0, block_size=4),
        lambda: NamespaceConfig(TARGET, num_blocks=4, block_size=-1),
        lambda: NamespaceConfig("", num_blocks=4, block_size=4),
        lambda: BlockLedger([]),
        lambda: BlockLedger([NamespaceConfig(TARGET, 4, 4), NamespaceConfig(TARGET, 8, 4)]),
    ],
)
def test_bad_configs_are_refused(make: Callable[[], object]) -> None:
    with pytest.raises(InvalidSize):
        make()
