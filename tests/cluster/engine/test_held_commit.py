"""HeldCommitKV: a held commit rides with the next reserve; any other ledger call sends it first."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.engine.held_commit import HeldCommitKV


class Recorder:
    """A KV client stand-in that records calls and answers one outcome per item."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def commit(self, items: list[Any]) -> list[str]:
        self.calls.append("commit")
        return ["ok"] * len(items)

    def reserve(self, items: list[Any]) -> list[str]:
        self.calls.append("reserve")
        return ["grant"] * len(items)

    def commit_then_reserve(self, commits: list[Any], reserves: list[Any]) -> tuple[list[str], list[str]]:
        self.calls.append("commit_then_reserve")
        return ["ok"] * len(commits), ["grant"] * len(reserves)

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append(name)


def make() -> tuple[HeldCommitKV, Recorder, list[tuple[Any, Any]]]:
    checked: list[tuple[Any, Any]] = []
    inner = Recorder()
    return HeldCommitKV(inner, lambda items, outcomes: checked.append((list(items), list(outcomes)))), inner, checked


def test_a_held_commit_rides_with_the_next_reserve() -> None:
    kv, inner, checked = make()
    kv.commit(["c1", "c2"], hold=True)
    assert inner.calls == [] and kv.held == ["c1", "c2"]
    assert kv.reserve(["r1"]) == ["grant"]
    assert inner.calls == ["commit_then_reserve"] and checked == [(["c1", "c2"], ["ok", "ok"])] and kv.held == []
    kv.reserve(["r2"])
    assert inner.calls[-1] == "reserve"  # nothing held: a plain reserve


@pytest.mark.parametrize(("method", "args"), [
    ("register_worker", ("w",)), ("expire_worker", ("w",)), ("can_admit", ([], 1)), ("admit", ([],)),
    ("rollback", ([],)), ("release", ("r", ["ns"])), ("audit", ()), ("commit", (["c2"],)),
])
def test_every_other_ledger_call_sends_a_held_commit_first(method: str, args: tuple[Any, ...]) -> None:
    kv, inner, checked = make()
    kv.commit(["c1"], hold=True)
    getattr(kv, method)(*args)
    assert inner.calls[:2] == ["commit", method] and checked[0] == (["c1"], ["ok"]) and kv.held == []


def test_reading_the_free_fraction_leaves_a_held_commit_held() -> None:
    kv, inner, _ = make()
    kv.commit(["c1"], hold=True)
    kv.free_fraction("ns")
    assert inner.calls == ["free_fraction"] and kv.held == ["c1"]
