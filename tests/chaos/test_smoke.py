"""The chaos smoke subset (drafter killed, verifier raising mid-forward, garbage drafts) against one live
cluster, with the same invariant checks as `specserve chaos run`, and the negative control: a known bug armed
on purpose (aborts skip the KV rollback) must be reported as a leak. Short durations: a few minutes in all.
Run inside the loopback-only namespace: scripts/in-netns.sh .venv/bin/python -m pytest -q tests/chaos
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.runner import SMOKE, ChaosRun, run_matrix

pytestmark = pytest.mark.timeout(1200)

DURATION_S = 6.0


@pytest.fixture(scope="module")
def cluster(ray_session: Any) -> Iterator[None]:
    from chaos.cluster import chaos_config, deploy_cluster, shutdown_cluster

    deploy_cluster(chaos_config())
    try:
        yield None
    finally:
        shutdown_cluster()


@pytest.fixture(scope="module")
def smoke(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> ChaosRun:
    return run_matrix(list(SMOKE), duration=DURATION_S, out_dir=tmp_path_factory.mktemp("chaos"), deploy=False,
                      concurrency=3)


@pytest.mark.parametrize("name", SMOKE)
def test_smoke_scenario_holds_every_invariant(smoke: ChaosRun, name: str) -> None:
    (result,) = [s for s in smoke.scenarios if s.name == name]
    verdict = result.verdict
    assert verdict.ok, verdict.violations
    assert result.faults, "no fault was injected"
    assert verdict.sent > 0 and verdict.completed_exact > 0
    assert (verdict.lost, verdict.diverged, verdict.duplicated, verdict.leaked_blocks) == (0, 0, 0, 0)
    assert result.journal_status == "completed"


def test_smoke_report_is_written(smoke: ChaosRun) -> None:
    for name in ("report.json", "report.md", "timeline.png"):
        assert (smoke.out_dir / name).stat().st_size > 0
    assert len(list(Path(smoke.out_dir, "journals").glob("*.json"))) == len(SMOKE)
    assert "| drafter-kill |" in (smoke.out_dir / "report.md").read_text()


def test_smoke_faults_were_seen_by_the_engine(smoke: ChaosRun) -> None:
    """Each fault left its mark: the drafter kill and the garbage drafts as fallback events."""
    by_name = {s.name: s for s in smoke.scenarios}
    for name, event in (("drafter-kill", "drafter unavailable"), ("drafter-garbage", "drafter unavailable"),
                        ("verifier-raise", "verifier recovery")):
        figures = by_name[name].figures
        seen = {key: figures.get(key) for key in ("acceptance", "fault_log", "notes", "time_to_detect_s",
                                                  "time_to_first_success_s", "sent", "completed_exact")}
        assert event in figures["acceptance"]["fallback_events"], (name, seen)


def test_negative_control_reports_the_leak(smoke: ChaosRun, tmp_path: Path) -> None:
    """The same checks, with aborts skipping their KV rollback on purpose: the requests it cancels are surely
    running when their abort lands (200 tokens asked, cancelled after the 2nd chunk), so each one leaks, and
    the run must fail on it: blocks held once idle, and the ledger holding requests the engine does not run."""
    control = run_matrix(["negative-control"], duration=DURATION_S, out_dir=tmp_path, deploy=False, concurrency=3)
    (result,) = control.scenarios
    verdict = result.verdict
    skipped = result.figures["fired"]["Scheduler"].get("engine.skip_abort_rollback", 0)
    assert verdict.cancelled > 0 and skipped > 0, (verdict, result.figures["fired"])
    assert not verdict.ok
    assert verdict.held_blocks > 0, verdict
    assert verdict.ledger_check is not None and "not running" in verdict.ledger_check, verdict.ledger_check
    assert any(v.startswith("KV:") for v in verdict.violations), verdict.violations
    assert (verdict.lost, verdict.diverged, verdict.duplicated) == (0, 0, 0), verdict.violations
