"""Who may write what (docs/ARCHITECTURE.md §3, "Writers"), checked on the source itself:

- a RequestState's token and cache fields are written only by admission (admission.py), by the round's outcome
  (accept.py `accept_round`) and by RequestState's own methods (request_state.py: appending tokens, forgetting KV);
- a RoundPlan is frozen: its transitions are `dataclasses.replace` in round_plan.py, nowhere else;
- an engine is complete at construction: no code outside engine.py assigns an attribute of an engine.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from cluster.engine.request_state import new_request_state
from cluster.engine.round_plan import RoundPlan, plain, with_drafts
from specserve_types.api import GenerationRequest, SamplingParams, SpecParams

ROOT = Path(__file__).resolve().parents[3]
SOURCES = sorted(p for d in ("cluster", "chaos", "drafter_service", "verifier_service", "kv_manager")
                 for p in (ROOT / d).rglob("*.py"))
ENGINE_SOURCES = [p for p in SOURCES if p.parent == ROOT / "cluster" / "engine"]  # where RequestStates live
TOKEN_AND_CACHE = {"token_ids", "target_cached", "draft_cached", "admitted", "draft_admitted"}
STATE_WRITERS = {"cluster/engine/request_state.py", "cluster/engine/admission.py", "cluster/engine/accept.py"}


def assigned_attributes(tree: ast.AST, calls: bool = True) -> list[tuple[ast.Attribute, int]]:
    """Every attribute an assignment (plain, augmented, annotated, tuple) writes, and with `calls` every list an
    in-place call changes."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (calls and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in {"append", "extend", "insert", "pop", "clear"}):
            targets = [node.func.value]
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Attribute):
                found.append((target, node.lineno))
    return found


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_request_state_token_and_cache_fields_have_three_writers() -> None:
    offenders = [f"{relative(path)}:{line} .{attr.attr}"
                 for path in ENGINE_SOURCES if relative(path) not in STATE_WRITERS
                 for attr, line in assigned_attributes(ast.parse(path.read_text()))
                 if attr.attr in TOKEN_AND_CACHE]
    assert not offenders, offenders


def test_round_plans_change_only_in_round_plan_py() -> None:
    offenders = []
    for path in SOURCES:
        if relative(path) == "cluster/engine/round_plan.py":
            continue
        text = path.read_text()
        if "object.__setattr__" in text:
            offenders.append(f"{relative(path)}: object.__setattr__")
        if "RoundPlan" in text and ("dataclasses.replace(" in text or "import replace" in text):
            offenders.append(f"{relative(path)}: replaces fields of a RoundPlan")
    assert not offenders, offenders


def test_no_engine_attribute_is_set_from_outside() -> None:
    offenders = [f"{relative(path)}:{line} engine.{attr.attr}"
                 for path in SOURCES if relative(path) != "cluster/engine/engine.py"
                 for attr, line in assigned_attributes(ast.parse(path.read_text()), calls=False)
                 if isinstance(attr.value, ast.Name) and attr.value.id == "engine"]
    assert not offenders, offenders


def test_a_round_plan_is_a_value() -> None:
    request = GenerationRequest("r", (1, 2, 3), SamplingParams(max_tokens=4), SpecParams(k=2, draft="ngram"))
    state = new_request_state(request, None, frozenset(), 10, 64, has_drafter=False)
    plan = RoundPlan(state=state, k=2, target_pending=[3], drafts=[1, 2])
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.k = 0  # type: ignore[misc]
    plainly = plain(plan, "test")
    assert (plan.k, plan.drafts) == (2, [1, 2]) and (plainly.k, plainly.drafts) == (0, [])
    drafted = with_drafts(plainly, [4], None)
    assert drafted.drafts == [4] and plainly.drafts == []
