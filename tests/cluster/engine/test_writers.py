"""Who may write what (docs/ARCHITECTURE.md §3, "Writers"), checked on the source itself:

- a RequestState's token and cache fields are written only by admission (admission.py), by the round's outcome
  (accept.py `accept_round`) and by RequestState's own methods (request_state.py: appending tokens, forgetting KV);
- a RoundPlan is frozen: its transitions are `dataclasses.replace` in round_plan.py, nowhere else;
- every other RequestState field has the writers docs/ARCHITECTURE.md §3's table names (`FIELD_WRITERS`); a
  round's k, its reason and the plain-decoding rounds are a plan's intent (RoundPlan.reason, rounds_at_zero) that
  the engine alone records (`record_k`), the planners and `plain` write nothing;
- an engine is complete at construction, and its lists are its own: no code outside engine.py writes an engine's
  attribute or anything under one (`engine.x = `, `engine.x.y = `, `engine.x[k] = `, `engine.x.append(...)`), be it
  through a parameter named `engine` or one typed as the engine or as a Protocol (a collaborator returns what it
  decided, the engine applies it: give_back.py's `GiveBack`).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from cluster.engine.acceptance_stats import AcceptanceStats
from cluster.engine.engine import record_k
from cluster.engine.planner import PlanContext, plan_request
from cluster.engine.request_state import new_request_state
from cluster.engine.round_plan import RoundPlan, plain, with_drafts
from cluster.engine.spec_policy import CostModel
from specserve_types.api import GenerationRequest, SamplingParams, SpecParams

ROOT = Path(__file__).resolve().parents[3]
SOURCES = sorted(p for d in ("cluster", "chaos", "drafter_service", "verifier_service", "kv_manager")
                 for p in (ROOT / d).rglob("*.py"))
ENGINE_SOURCES = [p for p in SOURCES if p.parent == ROOT / "cluster" / "engine"]  # where RequestStates live
TOKEN_AND_CACHE = {"token_ids", "target_cached", "draft_cached", "admitted", "draft_admitted"}
STATE_WRITERS = {"cluster/engine/request_state.py", "cluster/engine/admission.py", "cluster/engine/accept.py"}
FIELD_WRITERS = {  # the other RequestState fields (ARCHITECTURE.md §3, "Writers"); request_state.py writes any
    ("k", "policy_events", "rounds_at_zero"): set(),  # RequestState.record_k, called by engine.py alone
    ("acceptance", "rounds", "first_token_at", "finished_at", "forced", "forced_accepted"): {"cluster/engine/accept.py"},
    ("finish_reason",): {"cluster/engine/accept.py", "cluster/engine/give_back.py"},
    ("draft_seconds", "verify_seconds", "reconcile_seconds"): {"cluster/engine/stats.py"},
    ("prompt_group",): {"cluster/engine/shared_prompts.py"},
    ("group", "admitted_at"): {"cluster/engine/admission.py"},
}
MUTATORS = {"append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft", "clear", "remove", "update",
            "setdefault", "add", "discard"}


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


def test_request_state_fields_have_their_writers() -> None:
    offenders = [f"{relative(path)}:{line} .{attr.attr}"
                 for path in ENGINE_SOURCES if relative(path) != "cluster/engine/request_state.py"
                 for attr, line in assigned_attributes(ast.parse(path.read_text()))
                 if ast.unparse(attr.value) in ("s", "state") or ast.unparse(attr.value).endswith(".state")
                 for fields, writers in FIELD_WRITERS.items() if attr.attr in fields and relative(path) not in writers]
    assert not offenders, offenders


def test_k_is_recorded_by_the_engine_alone() -> None:
    offenders = [f"{relative(path)}:{node.lineno}" for path in SOURCES
                 if relative(path) not in ("cluster/engine/engine.py", "cluster/engine/request_state.py")
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "record_k"]
    assert not offenders, offenders


def test_a_plan_is_an_intent_the_engine_records() -> None:
    request = GenerationRequest("r", (1, 2, 3), SamplingParams(max_tokens=8), SpecParams(k=None, draft="model"))
    state = new_request_state(request, None, frozenset(), 10, 64, has_drafter=True)
    context = PlanContext(k_max=4, probe_every=16, pressure_free_fraction=0.1, free_fraction=1.0,
                          drafter_usable=False, engine_acceptance=AcceptanceStats(), cost=CostModel(), batch=1)
    plan = plan_request(state, context)  # no drafter: plain decoding, and why
    assert (plan.k, plan.reason) == (0, "fallback: drafter unavailable, plain decoding")
    assert not state.policy_events and state.k == 0  # the planner wrote nothing
    record_k([plan])
    assert [(e.k, e.reason) for e in state.policy_events] == [(0, plan.reason)]
    counted = RoundPlan(state=state, k=3, target_pending=[3], reason="auto", rounds_at_zero=0)
    state.rounds_at_zero = 5
    record_k([counted])
    assert (state.k, state.rounds_at_zero, len(state.policy_events)) == (3, 0, 2)
    fallback = plain(counted, "draft cache out of blocks")  # recorded when verified; the count stays
    assert (state.k, fallback.rounds_at_zero, fallback.reason) == (3, 0, "draft cache out of blocks")
    record_k([fallback, fallback])  # a repeated k is recorded once
    assert [(e.k, e.reason) for e in state.policy_events][1:] == [(3, "auto"), (0, "draft cache out of blocks")]


def protocols() -> set[str]:
    """The Protocol classes of the sources (the engine as a collaborator sees it, its backends, ...)."""
    return {node.name for path in SOURCES for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Protocol") for b in node.bases)}


def writes_through(tree: ast.AST, hosts: set[str]) -> list[str]:
    """Writes under a parameter named `engine` or typed as one of `hosts`: assignments (plain, augmented,
    annotated, del) to an attribute or item anywhere under it, and in-place calls on one of its attributes."""
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
        params = {a.arg for a in args if a.arg == "engine" or (
            a.annotation is not None and set(ast.unparse(a.annotation).replace("|", " ").split()) & hosts)}
        for node in ast.walk(function):
            targets: list[ast.expr] = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                targets = [node.func.value]
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets.extend(target.elts)
                    continue
                root = target
                while isinstance(root, (ast.Attribute, ast.Subscript)):
                    root = root.value
                if target is not root and isinstance(root, ast.Name) and root.id in params:
                    found.append(f"{node.lineno} {ast.unparse(target)}")
    return found


def test_the_check_sees_nested_and_protocol_writes() -> None:
    source = """
def warm(engine):
    engine.cost.warm_up_samples = {}
    engine.totals["rounds"] += 1
    engine.x = 1
def requeue(parts: Host | None, state):
    parts.waiting.appendleft(state)
    parts.running.remove(state)
def reads(engine, host: Host):
    engine.kv.release("r", [])
    return host.running[0], engine.cost.draft_token
"""
    assert [f.split(" ", 1)[1] for f in writes_through(ast.parse(source), {"Host"})] == [
        "engine.cost.warm_up_samples", "engine.totals['rounds']", "engine.x", "parts.waiting", "parts.running"]


def test_no_engine_attribute_is_written_from_outside() -> None:
    hosts = protocols() | {"SpecEngine"}
    offenders = [f"{relative(path)}:{found}" for path in SOURCES if relative(path) != "cluster/engine/engine.py"
                 for found in writes_through(ast.parse(path.read_text()), hosts)]
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
